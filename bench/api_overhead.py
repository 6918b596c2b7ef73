"""What the Anthropic Messages API costs on top of Chat Completions through the gateway: one run, both printed.

`/v1/messages` is translated at the edge into the chat path (gateway/edge/api_messages.py), so the difference between
the two is the translation: validating the Anthropic body, building the chat request, and rewriting the answer (or
every stream event) on the way out. Measured the way bench/gateway_overhead.py measures (same throwaway Postgres,
bench/fast_upstream.py answering every chat request with the same recorded vLLM answer, `trajgate serve` with capture
on, CPU pinning, a keep-alive raw-socket client at concurrency 1, the two APIs alternating in blocks so drift hits
both alike), on the same prompt and the same 16-token answer:

  * non-stream, c=1: latency p50/p99 for chat and messages;
  * stream, c=1: time to the first event and to the end of the stream, p50/p99;
  * the translation alone, in process: µs per request and per answer (non-stream), per chunk (stream).

    .venv/bin/python bench/api_overhead.py            # ~30 s
    .venv/bin/python bench/api_overhead.py --requests 3000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.fast_upstream import FIXTURES, build_canned, load_fixtures  # noqa: E402
from bench.gateway_overhead import (  # noqa: E402
    GATEWAY_CPU,
    UPSTREAM_CPU,
    Processes,
    RawConnection,
    Samples,
    client_bodies,
    ms,
    pct,
    pin_postgres,
    run_c1,
    wait_http,
)
from tests.support.pgcluster import PgCluster, free_port  # noqa: E402

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"


def anthropic_body(chat_body: bytes) -> dict[str, Any]:
    """The same call in the Messages API: system messages become `system`, max_tokens stays."""
    chat = json.loads(chat_body)
    system = "".join(m["content"] for m in chat["messages"] if m["role"] == "system")
    body: dict[str, Any] = {
        "model": chat["model"],
        "max_tokens": chat["max_tokens"],
        "messages": [m for m in chat["messages"] if m["role"] != "system"],
    }
    if system:
        body["system"] = system
    return body


def translation_cost(body: dict[str, Any], repeat: int = 2000) -> dict[str, float]:
    """µs per call of each translation step, in this process (no I/O)."""
    import orjson

    from gateway.edge.api_messages import MessagesRequest, StreamTranslator, parse_request, to_chat, to_message

    canned = build_canned()
    answer = orjson.loads(canned.routes[CHAT.encode()][0].split(b"\r\n\r\n", 1)[1])
    payloads = [
        line[6:].strip()
        for part in canned.routes[CHAT.encode()][1]
        for line in part.split(b"\r\n")
        if line.startswith(b"data: ")
    ]
    # The chat path hands the translator each chunk as a dict, and `[DONE]` as the end.
    chunks = [orjson.loads(payload) for payload in payloads if payload != b"[DONE]"]
    raw = orjson.dumps(body)

    def timed(work: Any) -> float:
        started = time.perf_counter_ns()
        for _ in range(repeat):
            work()
        return (time.perf_counter_ns() - started) / repeat / 1000

    def stream() -> None:
        translator = StreamTranslator()
        for chunk in chunks:
            translator.feed(chunk)
        translator.finish()

    return {
        "request (parse, validate, to chat, serialise)": timed(
            lambda: orjson.dumps(to_chat(parse_request(orjson.loads(raw), MessagesRequest)))
        ),
        "answer (to message, serialise)": timed(lambda: orjson.dumps(to_message(answer))),
        f"stream ({len(payloads)} events)": timed(stream),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000, help="non-stream requests per API (streams: half)")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="trajgate-api-bench-"))
    procs = Processes(workdir)
    cluster = PgCluster()
    try:
        return _run(args, workdir, procs, cluster)
    finally:
        procs.stop_all()
        cluster.destroy()
        shutil.rmtree(workdir, ignore_errors=True)


def _run(args: argparse.Namespace, workdir: Path, procs: Processes, cluster: PgCluster) -> int:
    served_model, plain, stream = client_bodies(load_fixtures(FIXTURES))
    messages_plain = json.dumps(anthropic_body(plain)).encode()
    messages_stream = json.dumps({**anthropic_body(plain), "stream": True}).encode()
    two_cpus = (os.cpu_count() or 1) >= 2
    pin = (lambda cpu: ["taskset", "-c", str(cpu)]) if two_cpus else (lambda cpu: [])

    cluster.start()
    if two_cpus:
        pin_postgres(cluster, str(UPSTREAM_CPU))
    from gateway.store import db

    db.upgrade(cluster.url())
    up_port, gw_port = free_port(), free_port()
    upstream = procs.start(
        "upstream",
        [*pin(UPSTREAM_CPU), sys.executable, str(REPO / "bench" / "fast_upstream.py"), "--port", str(up_port)],
    )
    wait_http(f"http://127.0.0.1:{up_port}/v1/models", upstream, 20)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJGATE_")}
    env.update(
        TRAJGATE_DATABASE_URL=cluster.url(),
        TRAJGATE_UPSTREAM_URL=f"http://127.0.0.1:{up_port}/v1",
        TRAJGATE_BASE_MODEL=served_model,
        TRAJGATE_SPOOL_DIR=str(workdir / "spool"),
        TRAJGATE_CHECKPOINT_DIR=str(workdir / "checkpoints"),
    )
    gateway = procs.start(
        "gateway",
        [
            *pin(GATEWAY_CPU),
            sys.executable,
            "-m",
            "gateway.cli",
            "serve",
            "--port",
            str(gw_port),
            "--log-level",
            "warning",
        ],
        env=env,
        cwd=REPO,
    )
    wait_http(f"http://127.0.0.1:{gw_port}/health", gateway, 60)
    if two_cpus:
        os.sched_setaffinity(0, {GATEWAY_CPU})

    chat_conn, messages_conn = RawConnection(gw_port), RawConnection(gw_port)
    for conn, path, body in ((chat_conn, CHAT, plain), (messages_conn, MESSAGES, messages_plain)):
        status, _, _ = conn.call(conn.request(path, body))
        if status != 200:
            print(f"{path} answered {status}; not benchmarking errors\n{procs.log_tail('gateway')}", file=sys.stderr)
            return 2
    block, warmup = 100, 100
    whole = run_c1(
        {
            "chat": (chat_conn, chat_conn.request(CHAT, plain)),
            "messages": (messages_conn, messages_conn.request(MESSAGES, messages_plain)),
        },
        args.requests, block, warmup, stream=False,
    )  # fmt: skip
    streams = run_c1(
        {
            "chat": (chat_conn, chat_conn.request(CHAT, stream)),
            "messages": (messages_conn, messages_conn.request(MESSAGES, messages_stream)),
        },
        args.requests // 2, block, warmup // 2, stream=True,
    )  # fmt: skip
    chat_conn.close()
    messages_conn.close()

    def row(label: str, samples: dict[str, Samples], key: str) -> str:
        values = {name: ms(getattr(s, key)) for name, s in samples.items()}
        cells = []
        for q in (50, 99):
            chat, messages = pct(values["chat"], q), pct(values["messages"], q)
            cells.append(f"p{q} chat {chat:7.3f}  messages {messages:7.3f}  added {messages - chat:+7.3f}")
        return f"{label:<24} " + "   ".join(cells)

    failed = {f"{kind} {name}": dict(s.failed) for kind, runs in (("non-stream", whole), ("stream", streams))
              for name, s in runs.items() if s.failed}  # fmt: skip
    print(f"\nthrough `trajgate serve`, capture on, fake upstream, c=1; {args.requests} non-stream and "
          f"{args.requests // 2} stream requests per API; milliseconds")  # fmt: skip
    print(row("non-stream latency", whole, "latency_ns"))
    print(row("stream first event", streams, "first_ns"))
    print(row("stream end", streams, "latency_ns"))
    if failed:
        print(f"non-200 answers: {failed}")
    print("\nthe translation alone, in process (µs):")
    for label, micros in translation_cost(anthropic_body(plain)).items():
        print(f"  {label:<48} {micros:8.1f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
