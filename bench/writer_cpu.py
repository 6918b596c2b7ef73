"""The writer thread's CPU per record in `write_calls`, for the traffic shapes the gateway sees (issue 18).

The writer shares a core and the GIL with the event loop, so its CPU per record (time.thread_time, client side:
SQLAlchemy, psycopg and the lineage work, not the server's) costs gateway throughput directly. Shapes:
  * single: every record its own trajectory and group (bench/gateway_overhead.py's traffic: no attribution, so each
    call gets a generated trajectory), a short chat prompt and a 16-token answer;
  * gateway: as single, with bench/gateway_overhead.py's own call as the gateway records it (its 4-message request,
    the recorded answer as stored);
  * few: trajectories of 3 calls, one turn of each per batch, so every later turn finds its predecessor stored;
  * multi: 24-turn agent trajectories (a growing chat history), one turn of each per batch.

    .venv/bin/python bench/writer_cpu.py                      # throwaway Postgres cluster
    .venv/bin/python bench/writer_cpu.py --url sqlite:////tmp/writer-cpu.db
    .venv/bin/python bench/writer_cpu.py --profile /tmp/writer.prof --shapes single --batches 64
    .venv/bin/python bench/writer_cpu.py --phases              # where the transaction's time goes, per batch
    .venv/bin/python bench/writer_cpu.py --stretches --shapes single   # the longest a call waits behind a batch

`--phases` times (wall clock, so waits on the database count) the parts of `write_calls` by wrapping the functions of
gateway.store.records that do each, every one timed exclusive of the others it calls: the plain insert (everything
not listed below: building the rows, the upserts, the commit), retry settlement (request hashes, `_settle`,
`_update_firsts`), lineage and delta storage (predecessors, from the lineage cache or the database, `classify`, message
digests and shared prefixes, reading the batch's stored rows), tree placement (`_in_tree` and a root's own agent) and
late arrivals (`_reparent_late`, and rebuilding a trajectory's stored calls, which orphans of a replaced call need).
The wrappers add a little time of their own, counted in the phase they wrap.

`--stretches` measures the writer's CPU between two of its yield points (`give_way`, where it pauses for the event loop
at low concurrency, gateway.store.courtesy): the longest a call can wait for the GIL behind a batch being written.

`--spill N Q` measures the writer's catch-up after an overload instead: N records of the first of `--shapes`
submitted to a RecordWriter (the real one: spool, queue, replay; the gateway's default priority, slices and pauses)
whose queue holds Q and which is not yet running, so N − Q spill to the write-ahead
log; then it starts and the script waits until all are stored: wall time, the process's CPU, and how many records
`write_calls` was given (N when only the spilled records are replayed from the log). Twice per `--repeat`, one after
the other: with the gateway between calls (none in flight, the last just ended: the writer gives way at each slice) and
quiet (none for a while, as after a burst: it does not, RecordWriter._pause).

`--turns L ...` measures how the work per record grows with a trajectory's length: agents of L turns (the `multi`
shape's growing history, 40 new prompt ids and 16 completion ids a turn on a 200-id system prompt), each sample over
one whole trajectory of every agent in the batch, and the ratio to the shortest L.

`--no-cache` writes without the writer's lineage cache, so every predecessor is rebuilt from the database: what a
gateway's writer does when another gateway wrote the call before (gateways behind a load balancer alternating turns),
or after a restart.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import math
import random
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere, like the other benchmarks
    sys.path.insert(0, str(REPO))

from sqlalchemy import Engine  # noqa: E402

from gateway.cli import tune_gc  # noqa: E402
from gateway.recorder.spool_lines import packed_arrays  # noqa: E402
from gateway.store import db  # noqa: E402
from gateway.store import records as store_records  # noqa: E402
from gateway.store.call_record import CallRecord  # noqa: E402
from gateway.store.courtesy import give_way  # noqa: E402
from gateway.store.records import LineageCache, write_calls  # noqa: E402
from tests.support.pgcluster import PgCluster, create_database, drop_database  # noqa: E402

ANSWER = "The capital of France is Paris."
Batches = Callable[[int, int], Iterator[list[CallRecord]]]


def _record(rng: random.Random, trajectory: str, group: str, seq: int, messages: list[dict[str, str]],
            prompt: list[int]) -> CallRecord:
    completion = [rng.randrange(50_000) for _ in range(16)]
    now = time.time()
    return CallRecord(
        id=uuid.uuid4().hex,
        run="bench",
        base_model="smollm2",
        trajectory_id=trajectory,
        group_id=group,
        group_size=None,
        mode="train",
        seq=seq,
        choice_index=0,
        policy_version=0,
        endpoint="chat",
        stream=False,
        request={"model": "bench", "messages": messages, "max_tokens": 16, "temperature": 0},
        response={
            "id": f"chatcmpl-{uuid.uuid4().hex[:16]}",
            "object": "chat.completion",
            "created": int(now),
            "model": "smollm2",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": ANSWER}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": 16, "total_tokens": len(prompt) + 16},
        },
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        completion_logprobs=[-rng.random() for _ in completion],
        finish_reason="length",
        usage={"prompt_tokens": len(prompt), "completion_tokens": 16, "total_tokens": len(prompt) + 16},
        status_code=200,
        error=None,
        trainable=True,
        untrainable_reason=None,
        latency_ms=3.2,
        ttft_ms=None,
        retry_count=0,
        idempotency_key=None,
        created_at=now,
    )


def single(batch: int, count: int) -> Iterator[list[CallRecord]]:
    rng = random.Random(0)
    question = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    for _ in range(count):
        out = []
        for _ in range(batch):
            trajectory = f"tg-{uuid.uuid4().hex}"
            record = _record(rng, trajectory, trajectory, 0, question, [rng.randrange(50_000) for _ in range(30)])
            out.append(replace(record, generated_trajectory=True))
        yield out


def gateway_call(batch: int, count: int) -> Iterator[list[CallRecord]]:
    """bench/gateway_overhead.py's call as the gateway records it: the same client request (a 4-message chat), the
    recorded answer as stored (slim, its ids and logprobs in their own columns), each call its own trajectory."""
    from bench.fast_upstream import FIXTURES, load_fixtures, pick_chat_fixture
    from bench.gateway_overhead import client_bodies
    from gateway.proxy.capture import choices_from_response, slim_response

    fixtures = load_fixtures(FIXTURES)
    recorded = fixtures[pick_chat_fixture(fixtures, 16)]["response"]
    request = orjson.loads(client_bodies(fixtures)[1])
    choice = choices_from_response(recorded, "chat")[0]
    completion, logprobs = (choice.completion_token_ids or [])[:16], (choice.logprobs or [])[:16]
    usage = {"prompt_tokens": len(choice.prompt_token_ids or ()), "completion_tokens": len(completion)}
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    rng = random.Random(2)
    for _ in range(count):
        out = []
        for _ in range(batch):
            trajectory = f"tg-{uuid.uuid4().hex}"
            record = _record(rng, trajectory, trajectory, 0, request["messages"], list(choice.prompt_token_ids or ()))
            out.append(replace(
                record, generated_trajectory=True, request=orjson.loads(orjson.dumps(request)),
                response=slim_response(recorded),
                completion_token_ids=list(completion), completion_logprobs=list(logprobs), usage=dict(usage),
            ))
        yield out


def _turns(turns: int) -> Batches:
    def batches(batch: int, count: int) -> Iterator[list[CallRecord]]:
        rng = random.Random(1)
        system = {"role": "system", "content": "You are a careful agent. " * 20}
        while count > 0:
            names = [f"agent-{uuid.uuid4().hex}" for _ in range(batch)]
            history: dict[str, tuple[list[dict[str, str]], list[int]]] = {
                name: ([system], [rng.randrange(50_000) for _ in range(200)]) for name in names
            }
            for seq in range(min(turns, count)):
                out = []
                for name in names:
                    messages, ids = history[name]
                    messages = [*messages, {"role": "user", "content": f"step {seq}: look at file {seq}.py"}]
                    ids = ids + [rng.randrange(50_000) for _ in range(40)]
                    record = _record(rng, name, f"group-{name}", seq, messages, ids)
                    out.append(record)
                    reply = {"role": "assistant", "content": ANSWER}
                    history[name] = ([*messages, reply], ids + (record.completion_token_ids or []))
                yield out
            count -= turns

    return batches


SHAPES: dict[str, Batches] = {"single": single, "gateway": gateway_call, "few": _turns(3), "multi": _turns(24)}


# The phases of `write_calls` (--phases): what of gateway.store.records each is timed by. The insert is the rest.
PHASES: dict[str, tuple[tuple[Any, str], ...]] = {
    "retry settlement": (
        (store_records, "request_hash"), (store_records, "_settle"), (store_records, "_update_firsts"),
    ),
    "lineage + delta": (
        (store_records, "_lineages"),  # its own part: reading the stored rows, orphan updates, the loop itself
        (store_records, "classify"), (store_records, "_with_messages"), (store_records, "message_digests"),
        (store_records, "_predecessor_at"), (store_records._TrajectoryView, "predecessor_at"),
        (store_records.LineageCache, "get"), (store_records.LineageCache, "remember"),
    ),
    "tree placement": (
        (store_records, "_in_tree"), (store_records, "_root_reason"), (store_records, "_stored_candidates"),
        (store_records._TrajectoryView, "same_agent_before"), (store_records._TrajectoryView, "_stored_first"),
    ),
    "late arrivals + orphans": ((store_records, "_reparent_late"), (store_records, "rebuild_calls")),
}


class PhaseTimer:
    """Wall time of each phase, exclusive: a wrapped function's time less that of the wrapped functions it calls."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(["insert", *PHASES], 0.0)
        self._stack: list[float] = []  # time the frames below spent in wrapped callees, one entry per frame
        self._saved: list[tuple[Any, str, Any]] = []

    def install(self) -> None:
        for phase, targets in PHASES.items():
            for owner, name in targets:
                original = getattr(owner, name)
                self._saved.append((owner, name, original))
                setattr(owner, name, self.timed(phase, original))

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def timed(self, phase: str, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._stack.append(0.0)
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                inner = self._stack.pop()
                self.seconds[phase] += elapsed - inner
                if self._stack:
                    self._stack[-1] += elapsed

        return timed

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)


def measure(
    engine: Engine,
    cache: LineageCache | None,
    shape: str | Batches,
    batch: int,
    count: int,
    profile: cProfile.Profile | None,
) -> float:
    """CPU microseconds per record over `count` batches, after one warm-up batch. `shape`: a name in SHAPES or the
    generator itself. Each record's arrays come packed, as the writer gets them from its write-ahead log line (the
    event loop packs them, outside this count)."""
    batches = list((SHAPES[shape] if isinstance(shape, str) else shape)(batch, count + 1))
    write_calls(engine, batches[0], cache)
    cpu = 0.0
    records = 0
    for records_batch in batches[1:]:
        packed = [packed_arrays(record) for record in records_batch]
        if profile is not None:
            profile.enable()
        start = time.thread_time()
        write_calls(engine, records_batch, cache, packed)
        cpu += time.thread_time() - start
        if profile is not None:
            profile.disable()
        records += len(records_batch)
    return cpu / records * 1e6


def phases(engine: Engine, cache: LineageCache | None, shape: str, batch: int, count: int) -> None:
    """Print the phases' ms per batch and share of `write_calls`, over `count` batches after one warm-up batch."""
    batches = list(SHAPES[shape](batch, count + 1))
    timer = PhaseTimer()
    write = timer.timed("insert", write_calls)  # what no other phase claims
    timer.install()
    try:
        write(engine, batches[0], cache)
        timer.reset()
        for records_batch in batches[1:]:
            write(engine, records_batch, cache)
    finally:
        timer.uninstall()
    total = sum(timer.seconds.values())
    records = sum(len(b) for b in batches[1:])
    shown = ", ".join(
        f"{phase} {seconds / count * 1000:.2f} ms ({seconds / total:.0%})" for phase, seconds in timer.seconds.items()
    )
    print(f"{engine.dialect.name} {shape:6} batch {batch:3} ({records:,} records): {total / count * 1000:.2f} ms a "
          f"batch = {shown}", flush=True)


def stretches(engine: Engine, cache: LineageCache | None, shape: str, batch: int, count: int) -> None:
    """Print the writer's CPU between two of its yield points (`give_way`), over `count` batches after one warm-up
    batch: the longest a call can wait for the GIL behind a batch being written (gateway.store.courtesy). Overall
    p50 / p99 / max, and the stretches that come once a batch by where they start and end, longest median first."""
    batches = list(SHAPES[shape](batch, count + 1))
    spans: dict[tuple[str, str], list[float]] = {}
    at = ["start", 0.0]

    def noting() -> None:
        now = time.thread_time()
        caller = sys._getframe(1)
        here = f"{caller.f_code.co_name}:{caller.f_lineno}"
        spans.setdefault((str(at[0]), here), []).append(now - float(at[1]))
        at[:] = [here, now]

    write_calls(engine, batches[0], cache)
    store_records.give_way = noting  # type: ignore[assignment]
    try:
        for records_batch in batches[1:]:
            at[:] = ["start", time.thread_time()]
            write_calls(engine, records_batch, cache)
            noting()  # the stretch from the last yield point to the commit's end
    finally:
        store_records.give_way = give_way
    every = sorted(seconds for found in spans.values() for seconds in found)

    def us(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))] * 1e6

    print(f"{engine.dialect.name} {shape:6} batch {batch:3}: {len(every):,} stretches, p50 {us(every, 0.5):.0f} / "
          f"p99 {us(every, 0.99):.0f} / max {every[-1] * 1e6:.0f} us CPU", flush=True)
    per_batch = [(where, sorted(found)) for where, found in spans.items() if len(found) <= count]
    for (start, end), found in sorted(per_batch, key=lambda item: -us(item[1], 0.5))[:5]:
        print(f"    {start} -> {end}: p50 {us(found, 0.5):.0f} us, max {found[-1] * 1e6:.0f} us", flush=True)


def spill(engine: Engine, shape: str, total: int, queue_size: int, quiet: bool) -> None:
    """The catch-up of a writer that fell `total - queue_size` records behind (see the module docstring), with the
    gateway's default writer settings (its priority, slices and pauses)."""
    import tempfile

    from gateway.recorder import writer as writer_module
    from gateway.runs.settings import Settings

    defaults = Settings()
    records = [record for batch in SHAPES[shape](total, 1) for record in batch]
    written = [0]

    def counting(engine: Engine, batch: list[CallRecord], *rest: Any) -> None:
        write_calls(engine, batch, *rest)
        written[0] += len(batch)

    writer_module.write_calls = counting  # type: ignore[assignment]
    try:
        with tempfile.TemporaryDirectory() as spool:
            writer = writer_module.RecordWriter(
                engine, Path(spool), queue_size=queue_size, slice_s=defaults.writer_slice_us / 1e6,
                pause_s=defaults.writer_pause_us / 1e6, nice=defaults.writer_nice,
                quiet_for=lambda: math.inf if quiet else 0.0,
            )
            for record in records:
                writer.submit(record)
            started, cpu = time.monotonic(), time.process_time()
            writer.start()
            stored = writer.flush(600)
            wall, cpu = time.monotonic() - started, time.process_time() - cpu
            writer.close()
    finally:
        writer_module.write_calls = write_calls
    state = "quiet" if quiet else "between calls"
    print(f"{engine.dialect.name} {shape} spill, gateway {state}: {total:,} records, queue {queue_size:,} "
          f"({writer.counters.records_spooled:,} spilled): stored {'all' if stored else 'NOT all'} in {wall:.2f} s, "
          f"{cpu:.2f} s CPU; write_calls given {written[0]:,} records, {writer.counters.records_replayed:,} replayed "
          "from the log", flush=True)


def scaling(engine: Engine, turns: list[int], batches: list[int], repeat: int, cold: bool) -> None:
    """CPU per record of agents whose trajectories hold `turns` calls, each measured over a whole trajectory (the
    growing history of `multi`), and its ratio to the shortest: how the writer's work per record grows with the calls
    a trajectory already holds."""
    for batch in batches:
        first = None
        for length in turns:
            cache = None if cold else LineageCache()
            per_record = min(measure(engine, cache, _turns(length), batch, length, None) for _ in range(repeat))
            first = first or per_record
            print(f"{engine.dialect.name} {length:4} turns batch {batch:3}: {per_record:6.0f} us/record CPU over the "
                  f"trajectory ({per_record / first:.1f}x the {turns[0]}-turn one)", flush=True)


def run(url: str, args: argparse.Namespace) -> None:
    db.upgrade(url)
    engine = db.make_engine(url)
    # The garbage collector as `trajgate serve` sets it, so the figures are the server's: with Python's defaults a
    # young-generation pass every 700 allocations was ~a tenth of the CPU of a long trajectory's records.
    tune_gc()
    if args.turns:
        try:
            scaling(engine, args.turns, args.batches, args.repeat, args.no_cache)
        finally:
            engine.dispose()
        return
    if args.spill:
        try:
            for _ in range(args.repeat):  # alternately, so the machine's drift hits both alike
                for quiet in (False, True):
                    spill(engine, args.shapes[0], *args.spill, quiet)
        finally:
            engine.dispose()
        return
    cache = None if args.no_cache else LineageCache()  # the writer's, one per process
    profile = cProfile.Profile(time.thread_time) if args.profile else None  # CPU, not waits
    try:
        for shape in args.shapes:
            if args.phases or args.stretches:
                for batch in args.batches:
                    (phases if args.phases else stretches)(engine, cache, shape, batch, args.count)
                continue
            for batch in args.batches:
                samples = [measure(engine, cache, shape, batch, args.count, profile) for _ in range(args.repeat)]
                shown = " ".join(f"{s:.0f}" for s in samples)
                print(f"{engine.dialect.name} {shape:6} batch {batch:3}: {min(samples):5.0f} us/record CPU "
                      f"(samples {shown})", flush=True)
    finally:
        engine.dispose()
    if profile is not None:
        profile.dump_stats(args.profile)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--url", help="Postgres server URL (a scratch database is made on it) or SQLite URL")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--batches", nargs="+", type=int, default=[16, 64, 128], help="records per write_calls")
    parser.add_argument("--count", type=int, default=24, help="batches measured per sample")
    parser.add_argument("--repeat", type=int, default=3, help="samples per shape and batch size")
    parser.add_argument("--profile", help="write cProfile stats of the measured batches here")
    parser.add_argument("--phases", action="store_true", help="time the phases of write_calls instead (see above)")
    parser.add_argument("--stretches", action="store_true",
                        help="instead: the writer's CPU between two of its yield points (see above)")
    parser.add_argument("--spill", nargs=2, type=int, metavar=("N", "Q"),
                        help="time the writer's catch-up after N records with a queue of Q instead (see above)")
    parser.add_argument("--no-cache", action="store_true",
                        help="write without the writer's lineage cache, as when another gateway wrote each predecessor")
    parser.add_argument("--turns", nargs="+", type=int, metavar="L",
                        help="instead: agents of L turns (multi's growing history), each measured over the whole "
                             "trajectory, per batch size (see above)")
    args = parser.parse_args()

    if args.url and args.url.startswith("sqlite"):
        Path(args.url.removeprefix("sqlite:///")).unlink(missing_ok=True)
        run(args.url, args)
        return
    cluster = None
    server = args.url
    if server is None:
        cluster = PgCluster()
        cluster.start()
        server = cluster.url()
    url = create_database(server.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        run(url, args)
    finally:
        drop_database(url)
        if cluster is not None:
            cluster.destroy()


if __name__ == "__main__":
    main()
