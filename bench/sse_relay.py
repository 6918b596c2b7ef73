"""CPU per SSE event of the gateway's stream relay (`Proxy._relay_stream`), without sockets or a database.

bench/gateway_overhead.py measures the whole gateway; at s=64 the relay's per-event work (parse, assemble, strip,
re-serialise) is a good share of it but lost in that run's noise. This drives the real `_relay_stream` of a real
`Proxy` (its metrics, `submit` and CallRecords included; tests/support/stream_relay.py) with the stream
bench/fast_upstream.py serves — the recorded `chat_stream` framing filled with the plain chat answer closest to 16
tokens: 18 JSON events and `[DONE]` — one SSE event per upstream read, as vLLM's chunked HTTP delivers them. Only
the upstream response, the ASGI `send`/`receive` and the writer are stubbed, so the figure is the relay's own CPU
plus a fixed per-stream part (the relay's tasks, metrics, the record).

    .venv/bin/python bench/sse_relay.py                     # every asks combination, a few seconds
    .venv/bin/python bench/sse_relay.py --asks none --streams 4000 --rounds 7
    .venv/bin/python bench/sse_relay.py --one-read          # the whole stream in one upstream read

It prints µs of CPU (process time) per SSE event and per stream for each combination of what the client asked
(logprobs / return_token_ids), best and median of the rounds. The machine's other load moves these figures:
compare runs taken alternately.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.fast_upstream import FIXTURES, load_fixtures, pick_chat_fixture, stream_from_answer  # noqa: E402
from gateway.proxy import capture  # noqa: E402
from gateway.store.models import CHAT  # noqa: E402
from tests.support.stream_relay import relay, relay_proxy, sse_reads  # noqa: E402

ASKS = {
    "none": capture.ClientAsks(logprobs=False, token_ids=False),
    "logprobs": capture.ClientAsks(logprobs=True, token_ids=False),
    "token_ids": capture.ClientAsks(logprobs=False, token_ids=True),
    "both": capture.ClientAsks(logprobs=True, token_ids=True),
}


async def _discard(message: dict[str, Any]) -> None:
    pass


async def cpu_seconds(reads: list[bytes], asks: capture.ClientAsks, streams: int) -> float:
    """CPU seconds for `streams` streams relayed one after another on this event loop."""
    proxy, writer = relay_proxy()
    start = time.process_time()
    for _ in range(streams):
        await relay(proxy, reads, CHAT, asks, _discard)
        writer.records.clear()
    return time.process_time() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--asks", choices=[*ASKS, "all"], default="all")
    parser.add_argument("--streams", type=int, default=2000, help="streams per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--one-read", action="store_true",
                        help="the whole stream in one upstream read (as the fake upstream's often arrives at s=64)")
    args = parser.parse_args(argv)

    fixtures = load_fixtures(FIXTURES)
    answer = fixtures[pick_chat_fixture(fixtures, args.max_tokens)]["response"]
    payloads = stream_from_answer(fixtures["chat_stream"]["chunks"], answer)
    reads = sse_reads(payloads)
    if args.one_read:
        reads = [b"".join(reads)]
    events = len(payloads)
    names = list(ASKS) if args.asks == "all" else [args.asks]
    print(f"{events} SSE events per stream ({events - 1} JSON + [DONE]) in {len(reads)} reads, "
          f"{args.streams} streams x {args.rounds} rounds")
    print(f"{'client asks':<12} {'us/event best':>14} {'median':>8} {'us/stream best':>15} {'median':>8}")
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(cpu_seconds(reads, ASKS["none"], 200))  # warm up
        for name in names:
            rounds = [loop.run_until_complete(cpu_seconds(reads, ASKS[name], args.streams)) for _ in range(args.rounds)]
            per_stream = [seconds / args.streams * 1e6 for seconds in rounds]
            best, median = min(per_stream), statistics.median(per_stream)
            print(f"{name:<12} {best / events:>14.2f} {median / events:>8.2f} {best:>15.1f} {median:>8.1f}")
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
