"""Stored bytes per trajectory as a conversation grows: full prompts per call (the layout before revision 0004) vs
linear storage (each call stores only the prompt ids past what it shares with its predecessor).

A synthetic N-turn chat (plain turns that extend: user message + template glue + completion, ~470 tokens a turn,
~30k tokens at 64 turns) is written straight into the store (SQLite, one call per batch, as the writer does at low
traffic), not through the gateway: the fake upstream replays recorded answers, so its ids do not extend from turn
to turn the way a real model's do. The "before" token bytes are computed from the same rows (full prompt = prefix +
stored suffix, 4 bytes a token), since before 0004 every call stored its full prompt. Request JSON is stored whole
in both layouts (it still grows with the square of the turns; the column is reported on its own).

Run: `python bench/storage.py [--turns 8 16 32 64]`.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from sqlalchemy import Text, cast, func, select  # noqa: E402

from gateway.records import CallRecord  # noqa: E402
from gateway.store import db  # noqa: E402
from gateway.store.models import Call  # noqa: E402
from gateway.store.records import write_calls  # noqa: E402

USER_TOKENS = 300
COMPLETION_TOKENS = 160
GLUE = [1, 4093, 198]  # "<|im_start|>user\n"-like template tokens between turns


def conversation(turns: int, seed: int) -> list[CallRecord]:
    """Calls of one trajectory whose prompts each extend the previous prompt + completion."""
    rng = random.Random(seed)
    trajectory_id = uuid.uuid4().hex
    history: list[int] = [1, 9690, 198]
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are a helpful assistant."}]
    records = []
    for turn in range(turns):
        user = [rng.randrange(10, 49_000) for _ in range(USER_TOKENS)]
        prompt = history + GLUE + user + [2, 198, 1, 520, 9531, 198]
        completion = [rng.randrange(10, 49_000) for _ in range(COMPLETION_TOKENS - 1)] + [2]
        messages = messages + [{"role": "user", "content": "w" * (4 * USER_TOKENS)}]
        records.append(
            CallRecord(
                id=uuid.uuid4().hex,
                run="bench",
                base_model="smollm2",
                trajectory_id=trajectory_id,
                group_id=f"g-{trajectory_id}",
                group_size=1,
                mode="train",
                seq=turn + 1,
                choice_index=0,
                policy_version=0,
                endpoint="chat",
                stream=False,
                request={"model": "bench", "messages": messages, "max_tokens": COMPLETION_TOKENS},
                response={
                    "id": f"chatcmpl-{turn}",
                    "object": "chat.completion",
                    "model": "smollm2",
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "a" * (4 * COMPLETION_TOKENS)},
                            "finish_reason": "stop",
                        }
                    ],
                },
                prompt_token_ids=prompt,
                completion_token_ids=completion,
                completion_logprobs=[-rng.random() for _ in completion],
                finish_reason="stop",
                usage={"prompt_tokens": len(prompt), "completion_tokens": len(completion)},
                status_code=200,
                error=None,
                trainable=True,
                untrainable_reason=None,
                latency_ms=10.0,
                ttft_ms=None,
                retry_count=0,
                idempotency_key=None,
                created_at=time.time() + turn * 1e-3,
            )
        )
        messages = messages + [{"role": "assistant", "content": "a" * (4 * COMPLETION_TOKENS)}]
        history = prompt + completion
    return records


def measure(turns: int, directory: Path) -> dict[str, float]:
    url = f"sqlite:///{directory / f'storage-{turns}.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    try:
        records = conversation(turns, seed=turns)
        started = time.perf_counter()
        for record in records:
            write_calls(engine, [record])
        write_ms = (time.perf_counter() - started) * 1000 / turns
        with engine.connect() as conn:
            row = conn.execute(
                select(
                    func.count(),
                    func.sum(func.length(Call.prompt_token_ids)),
                    func.sum(Call.prefix_len),
                    func.sum(func.length(Call.completion_token_ids) + func.length(Call.completion_logprobs)),
                    func.sum(func.length(cast(Call.request, Text))),
                    func.sum(func.length(cast(Call.response, Text))),
                )
            ).one()
    finally:
        engine.dispose()
    rows, prompt_bytes, prefix_tokens, completion_bytes, request_bytes, response_bytes = row
    final_tokens = len(records[-1].prompt_token_ids or []) + len(records[-1].completion_token_ids or [])
    other = completion_bytes + request_bytes + response_bytes
    return {
        "turns": turns,
        "rows": rows,
        "final_tokens": final_tokens,
        "ids_before": (prompt_bytes + 4 * prefix_tokens) / 4 + completion_bytes / 8,
        "ids_after": prompt_bytes / 4 + completion_bytes / 8,
        "bytes_before": prompt_bytes + 4 * prefix_tokens + other,
        "bytes_after": prompt_bytes + other,
        "token_bytes_before": prompt_bytes + 4 * prefix_tokens + completion_bytes,
        "token_bytes_after": prompt_bytes + completion_bytes,
        "request_bytes": request_bytes,
        "write_ms": write_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, nargs="+", default=[8, 16, 32, 64])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = [measure(turns, Path(tmp)) for turns in args.turns]
    header = (
        f"{'turns':>5} {'rows':>4} {'final tok':>9} {'ids stored before':>17} {'after':>7} "
        f"{'token KB before':>15} {'after':>7} {'x':>5} {'all KB before':>13} {'after':>7} {'x':>5} "
        f"{'request KB':>10} {'write ms/call':>13}"
    )
    print(header)
    for r in results:
        print(
            f"{r['turns']:>5} {r['rows']:>4} {r['final_tokens']:>9} {r['ids_before']:>17.0f} {r['ids_after']:>7.0f} "
            f"{r['token_bytes_before'] / 1024:>15.1f} {r['token_bytes_after'] / 1024:>7.1f} "
            f"{r['token_bytes_before'] / r['token_bytes_after']:>5.1f} "
            f"{r['bytes_before'] / 1024:>13.1f} {r['bytes_after'] / 1024:>7.1f} {r['bytes_before'] / r['bytes_after']:>5.1f} "
            f"{r['request_bytes'] / 1024:>10.1f} {r['write_ms']:>13.2f}"
        )
    print("growth per doubling of turns (all bytes, before -> after):")
    for small, big in zip(results, results[1:]):
        if big["turns"] == 2 * small["turns"]:
            print(
                f"  {small['turns']:>2} -> {big['turns']:>2}: x{big['bytes_before'] / small['bytes_before']:.2f} -> "
                f"x{big['bytes_after'] / small['bytes_after']:.2f}  (token bytes only: "
                f"x{big['token_bytes_before'] / small['token_bytes_before']:.2f} -> "
                f"x{big['token_bytes_after'] / small['token_bytes_after']:.2f})"
            )


if __name__ == "__main__":
    main()
