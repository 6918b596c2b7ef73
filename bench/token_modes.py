"""The two token modes on one long tool conversation, through the real gateway and store: what each costs in stored
bytes, latency per turn, and what the trainer gets from it.

A synthetic 64-turn tool conversation (~30k tokens: a user message or tool result of `--message-words` words, then
an answer of `--completion-words`; the "model" calls get_weather after every user message and answers in text after
every tool result, so half the turns follow a tool call) runs through `trajgate`'s gateway (in this process, SQLite
in a temporary directory) against bench/token_upstream.py, a vLLM stand-in with a toy tokenizer and a ChatML
template that drops assistant tool calls on re-render as SmolLM2's does (what is synthetic is listed there; SmolLM2's
8k context is too short for this conversation). The client is an agent loop over httpx that echoes each answer back
the way the OpenAI SDK's users do. Non-stream only.

Columns, per trajectory at each turn count (the same conversation cut at that many turns):
- stored bytes as written (ids = prompt + completion ids and logprobs; request and response = JSON text; total), and
  `full`: what the same calls would take with every row holding its whole prompt and request (the layout before
  linear storage), from the rebuilt calls;
- ms per turn as the client sees it (median), and the direct upstream call for the same body as the floor;
- the trainer's rows per trajectory and tokens per step (the sum of the row lengths it processes) from the sample
  builder on the stored calls, and the merge ratio.

Run: `python bench/token_modes.py [--turns 8 16 32 64]`.
"""

from __future__ import annotations

import argparse
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import httpx  # noqa: E402
import orjson  # noqa: E402

from bench.storage import _stored_bytes  # noqa: E402
from bench.token_upstream import WORDS  # noqa: E402
from gateway.store import db  # noqa: E402
from gateway.store.training import load_groups  # noqa: E402
from tests.support.gateway_harness import running_gateway  # noqa: E402
from tests.support.stored import stored_calls  # noqa: E402
from tests.support.waiting import wait_until  # noqa: E402
from trainer.samples import build_samples  # noqa: E402
from trainer.worker.loop import to_groups  # noqa: E402

MODES = ("chat", "token_in")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _echoed(message: dict[str, Any]) -> dict[str, Any]:
    """The assistant message as an SDK agent appends it (`model_dump(exclude_none=True)`, empty lists kept)."""
    return {k: v for k, v in message.items() if v is not None and k in ("role", "content", "tool_calls")}


def converse(client: httpx.Client, url: str, run: str, turns: int, words: int, seed: int) -> list[float]:
    """One agent conversation of `turns` calls; returns the client's ms per call."""
    rng = random.Random(seed)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful assistant with tools."},
        {"role": "user", "content": _text(rng, words)},
    ]
    times = []
    for _ in range(turns):
        body = {"model": run, "messages": messages, "max_tokens": 1024}
        started = time.perf_counter()
        response = client.post(url, content=orjson.dumps(body), headers={"content-type": "application/json"})
        times.append((time.perf_counter() - started) * 1000)
        response.raise_for_status()
        message = response.json()["choices"][0]["message"]
        messages.append(_echoed(message))
        if message.get("tool_calls"):
            call_id = message["tool_calls"][0]["id"]
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _text(rng, words)})
        else:
            messages.append({"role": "user", "content": _text(rng, words)})
    return times


def _full_bytes(calls: list[dict[str, Any]]) -> dict[str, int]:
    """Bytes of the calls if every row held its whole prompt and request (ids packed 4 bytes a token)."""
    ids = sum(4 * (len(c["prompt_token_ids"]) + 2 * len(c["completion_token_ids"])) for c in calls)
    request = sum(len(orjson.dumps(c["request"])) for c in calls)
    response = sum(len(orjson.dumps(c["response"])) for c in calls)
    return {"ids": ids, "request": request, "response": response, "total": ids + request + response}


def measure(gateway_url: str, upstream_url: str, database_url: str, turns: int, words: int) -> dict[str, Any]:
    out: dict[str, Any] = {"turns": turns}
    with httpx.Client(timeout=120) as client:
        direct = converse(client, upstream_url + "/chat/completions", "smollm2", turns, words, seed=turns)
        out["direct_ms"] = statistics.median(direct)
        for mode in MODES:
            trajectory = f"{mode}-{turns}-{uuid.uuid4().hex[:6]}"
            url = f"{gateway_url}/g/{trajectory}/n/1/t/{trajectory}/v1/chat/completions"
            times = converse(client, url, f"bench-{mode}", turns, words, seed=turns)
            last8 = statistics.median(times[-8:])
            out[mode] = {"trajectory": trajectory, "ms": statistics.median(times), "ms_last8": last8}
    return out


def finish(engine: Any, database_url: str, result: dict[str, Any]) -> None:
    """Stored bytes and what the trainer builds, once the gateway has flushed."""
    for mode in MODES:
        entry = result[mode]
        trajectory = entry["trajectory"]
        calls = stored_calls(database_url, trajectory)
        entry["stored"] = _stored_bytes(engine, [trajectory])
        entry["full"] = _full_bytes(calls)
        entry["tokens"] = len(calls[-1]["prompt_token_ids"]) + len(calls[-1]["completion_token_ids"])
        with engine.begin() as conn:
            conn.exec_driver_sql("UPDATE trajectories SET reward = 1.0 WHERE trajectory_id = ?", (trajectory,))
        (group,) = to_groups(load_groups(engine, [trajectory]))
        stats = build_samples([group], drop_zero_variance=False).stats
        entry.update(rows=stats["rows"], train_tokens=stats["tokens"], merge_ratio=stats["merge_ratio"])


def _report(results: list[dict[str, Any]]) -> None:
    print("\nstored bytes per trajectory (as written / every row whole), rows and trainer tokens per trajectory")
    head = (f"{'turns':>5} {'tokens':>6} {'mode':>8} | {'ids':>9} {'request':>9} {'response':>9} {'total':>9} | "
            f"{'full total':>10} {'x':>5} | {'ms/turn':>7} {'last 8':>7} {'direct':>6} | {'rows':>4} "
            f"{'train tok':>9} {'merge':>5}")  # fmt: skip
    print(head)
    print("-" * len(head))
    for result in results:
        for mode in MODES:
            e = result[mode]
            s, f = e["stored"], e["full"]
            print(f"{result['turns']:>5} {e['tokens']:>6} {mode:>8} | {s['ids']:>9,} {s['request']:>9,} "
                  f"{s['response']:>9,} {s['total']:>9,} | {f['total']:>10,} {f['total'] / s['total']:>5.1f} | "
                  f"{e['ms']:>7.1f} {e['ms_last8']:>7.1f} {result['direct_ms']:>6.1f} | {e['rows']:>4} "
                  f"{e['train_tokens']:>9,} {e['merge_ratio']:>5.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--message-words", type=int, default=300)
    parser.add_argument("--completion-words", type=int, default=150)
    args = parser.parse_args()
    port = _free_port()
    upstream = subprocess.Popen(
        [sys.executable, str(REPO_ROOT / "bench" / "token_upstream.py"), "--port", str(port),
         "--completion-words", str(args.completion_words)],
    )  # fmt: skip
    upstream_url = f"http://127.0.0.1:{port}/v1"
    try:
        wait_until(lambda: _answers(upstream_url), 30, "the bench upstream to answer")
        with tempfile.TemporaryDirectory() as tmp:
            database_url = f"sqlite:///{tmp}/trajgate.db"
            results = []
            settings = {"database_url": database_url, "upstream_url": upstream_url, "base_model": "smollm2"}
            with running_gateway(**settings, spool_dir=Path(tmp) / "spool") as gateway:
                for mode in MODES:
                    body = {"name": f"bench-{mode}", "config": {"token_mode": mode}}
                    httpx.post(gateway.url + "/v1/runs", json=body, timeout=30).raise_for_status()
                for turns in args.turns:
                    results.append(measure(gateway.url, upstream_url, database_url, turns, args.message_words))
                gateway.flush()
            engine = db.make_engine(database_url)
            try:
                for result in results:
                    finish(engine, database_url, result)
            finally:
                engine.dispose()
        _report(results)
    finally:
        upstream.terminate()
        upstream.wait(10)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url + "/models", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    main()
