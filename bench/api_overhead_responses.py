"""What the OpenAI Responses API adds over Chat Completions through the gateway: one run, both APIs, one table.

The Responses API is translated at the edge to the chat path (gateway/edge/api_responses.py), so the same upstream call
happens either way; this measures the translation (request -> chat body, chat answer -> Response object / events,
the in-memory store of the answer). Started here: bench/fast_upstream.py (a vLLM-shaped fake answering a recorded
vLLM answer of ~16 tokens, stream and non-stream) and `trajgate serve` with capture on (SQLite). One keep-alive client
at concurrency 1 sends the same question as a chat request and as a Responses request, alternating in blocks so drift
hits both alike; latency is client-side, request sent to answer read (stream: to the first event and to the end).

    .venv/bin/python bench/api_overhead_responses.py            # ~1,000 calls per scenario
    .venv/bin/python bench/api_overhead_responses.py --quick
"""

from __future__ import annotations

import argparse
import http.client
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.support.gateway_harness import start_serve  # noqa: E402
from tests.support.pgcluster import free_port  # noqa: E402
from tests.support.waiting import wait_until  # noqa: E402

QUESTION = "What is the capital of France? Answer in one sentence."
BODIES = {
    ("chat", False): ("/v1/chat/completions",
                      {"model": "smollm2", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 16}),
    ("responses", False): ("/v1/responses", {"model": "smollm2", "input": QUESTION, "max_output_tokens": 16}),
    ("chat", True): ("/v1/chat/completions",
                     {"model": "smollm2", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 16,
                      "stream": True, "stream_options": {"include_usage": True}}),
    ("responses", True): ("/v1/responses",
                          {"model": "smollm2", "input": QUESTION, "max_output_tokens": 16, "stream": True}),
}  # fmt: skip


def one_call(conn: http.client.HTTPConnection, path: str, body: bytes) -> tuple[float, float]:
    """(ms to the first body bytes, ms to the end of the answer)."""
    started = time.perf_counter_ns()
    conn.request("POST", path, body=body, headers={"content-type": "application/json"})
    response = conn.getresponse()
    first = response.read1(65536)
    first_ns = time.perf_counter_ns()
    rest = response.read()
    end_ns = time.perf_counter_ns()
    if response.status != 200 or not (first + rest):
        raise RuntimeError(f"{path} answered {response.status}: {(first + rest)[:300]!r}")
    return (first_ns - started) / 1e6, (end_ns - started) / 1e6


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(port: int, calls: int, block: int, warmup: int) -> dict[tuple[str, bool], tuple[list[float], list[float]]]:
    conn = http.client.HTTPConnection("127.0.0.1", port)
    encoded = {key: (path, json.dumps(body).encode()) for key, (path, body) in BODIES.items()}
    for key in encoded:
        for _ in range(warmup):
            one_call(conn, *encoded[key])
    results: dict[tuple[str, bool], tuple[list[float], list[float]]] = {key: ([], []) for key in encoded}
    for _ in range(max(calls // block, 1)):
        for key in encoded:
            firsts, totals = results[key]
            for _ in range(block):
                first, total = one_call(conn, *encoded[key])
                firsts.append(first)
                totals.append(total)
    conn.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="200 calls per scenario instead of 1,000")
    args = parser.parse_args(argv)
    calls = 200 if args.quick else 1000
    upstream_port = free_port()
    upstream = subprocess.Popen(
        [sys.executable, str(REPO / "bench" / "fast_upstream.py"), "--port", str(upstream_port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    gateway = None
    try:
        wait_until(lambda: _answers(upstream_port), 30, "the fake upstream to answer")
        with tempfile.TemporaryDirectory() as tmp:
            gateway, output, port = start_serve(
                f"http://127.0.0.1:{upstream_port}/v1", f"sqlite:///{tmp}/trajgate.db", Path(tmp) / "spool"
            )
            results = measure(port, calls, block=50, warmup=50)
            gateway.terminate()
            gateway.wait(30)
            output.finish()
    finally:
        upstream.terminate()
        upstream.wait(10)
        if gateway is not None and gateway.poll() is None:
            gateway.kill()
    print(f"Responses vs Chat Completions through the gateway (fake upstream, capture on, SQLite, c=1, "
          f"{calls} calls each, ms)")  # fmt: skip
    print(f"{'scenario':<28}{'chat p50':>10}{'resp p50':>10}{'added':>8}{'chat p99':>10}{'resp p99':>10}{'added':>8}")
    for stream in (False, True):
        measures = [("first event", 0), ("whole stream", 1)] if stream else [("whole answer", 1)]
        for label, which in measures:
            chat, resp = results[("chat", stream)][which], results[("responses", stream)][which]
            c50, r50, c99, r99 = pct(chat, 0.5), pct(resp, 0.5), pct(chat, 0.99), pct(resp, 0.99)
            name = f"{'stream' if stream else 'non-stream'} {label}"
            print(f"{name:<28}{c50:>10.3f}{r50:>10.3f}{r50 - c50:>+8.3f}{c99:>10.3f}{r99:>10.3f}{r99 - c99:>+8.3f}")
    return 0


def _answers(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
        conn.request("GET", "/v1/models")
        ok = conn.getresponse().status == 200
        conn.close()
        return ok
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
