"""RecordWriter: every submitted record reaches the database exactly once, through outages, overload and restarts,
and `submit` never waits on the database."""

from __future__ import annotations

import asyncio
import copy
import gc
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
from sqlalchemy import Engine, select

from gateway.app import build_state
from gateway.recorder import threads
from gateway.recorder import writer as writer_module
from gateway.recorder.spool import Syncer
from gateway.recorder.spool_lines import packed_arrays, read_spool_line, read_spool_record, spool_line
from gateway.recorder.writer import RecordWriter
from gateway.runs.settings import Settings
from gateway.store import db
from gateway.store.arrays import PackedArrays, decode_ids, decode_logprobs, pack_arrays
from gateway.store.call_record import CallRecord
from gateway.store.models import Call
from gateway.store.records import count_calls, write_calls
from tests.support.factories import make_record
from tests.support.pgcluster import PgCluster, free_port
from tests.support.waiting import wait_until

FAST = {"flush_interval_s": 0.01, "retry_interval_s": 0.1}
# SCHED_IDLE and sched_getscheduler exist only on Linux; elsewhere the writer keeps its priority, and off-Linux tests
# below check that nothing is changed there.
LINUX_ONLY = pytest.mark.skipif(sys.platform != "linux", reason="SCHED_IDLE exists only on Linux")


@pytest.fixture
def spool_dir(tmp_path: Path) -> Path:
    return tmp_path / "spool"


def _records(count: int) -> list[CallRecord]:
    return [make_record(f"t{i // 10}", i % 10, group_id=f"g{i // 40}") for i in range(count)]


def _written(writer: RecordWriter, count: int) -> list[CallRecord]:
    """`count` records submitted to the started `writer`, once it has stored them all."""
    records = _records(count)
    for record in records:
        writer.submit(record)
    assert writer.flush(20)
    return records


def _ids(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(select(Call.id)).scalars())


def _segments(spool_dir: Path) -> list[Path]:
    return sorted(spool_dir.glob("spool-*.jsonl"))


def test_spool_line_round_trips_exactly() -> None:
    record = make_record(completion_tokens=50, seed=3, request={"logit_bias": {"50256": -100}})
    record.completion_logprobs[1] = math.nan
    back = read_spool_line(spool_line(record))
    assert back.completion_logprobs[0] == -math.inf and math.isnan(back.completion_logprobs[1])
    assert back.completion_logprobs[2:] == record.completion_logprobs[2:]
    back.completion_logprobs = record.completion_logprobs = None
    assert back == record
    int_keys = make_record(request={"logit_bias": {50256: -100}})  # orjson's slower mode, only when needed
    assert read_spool_line(spool_line(int_keys)).request == {"logit_bias": {"50256": -100}}
    unpackable = make_record(prompt_token_ids=[2**40])  # kept as JSON, so the store can refuse it and keep it aside
    assert read_spool_line(spool_line(unpackable)).prompt_token_ids == [2**40]


def test_every_field_of_a_spool_line_reads_back_into_its_own_place_and_an_older_line_reads_as_none() -> None:
    """The record is rebuilt from its line by position: each field, set to a value no other field has, must land in
    its own place; a line spooled before the token_in fields existed reads them as None."""
    record = make_record(
        group_size=7,
        ttft_ms=3.25,
        idempotency_key="key-1",
        error="error-1",
        untrainable_reason="reason-1",
        history_key="history-1",
        segment_reason="segment-1",
        predecessor_seq=11,
        predecessor_choice=13,
        retry_count=17,
    )
    assert read_spool_line(spool_line(record)) == record
    older = orjson.loads(spool_line(record))
    for name in ("history_key", "segment_reason", "predecessor_seq", "predecessor_choice"):
        del older[name]
    back = read_spool_line(orjson.dumps(older))
    assert (back.history_key, back.segment_reason, back.predecessor_seq, back.predecessor_choice) == (None,) * 4
    assert (back.id, back.retry_count, back.idempotency_key, back.created_at) == (
        record.id,
        17,
        "key-1",
        record.created_at,
    )


def test_a_spool_line_carries_the_packed_arrays_its_row_stores() -> None:
    """The writer hands write_calls the arrays its log line packed, and replay the arrays it reads from a line: the
    very bytes `pack_arrays` gives, the same line whether or not the caller packed them first; none where one array
    could not be packed (the store then packs the lists, and refuses them)."""
    record = make_record(completion_tokens=50, seed=3)
    packed = packed_arrays(record)
    assert packed == pack_arrays(record.prompt_token_ids, record.completion_token_ids, record.completion_logprobs)
    assert spool_line(record, packed) == spool_line(record)
    assert read_spool_record(spool_line(record, packed)) == (record, packed)
    no_answer = make_record(completion_token_ids=None, completion_logprobs=None)
    assert read_spool_record(spool_line(no_answer))[1] == (packed_arrays(no_answer).prompt, None, None)
    unpackable = make_record(prompt_token_ids=[2**40])
    assert packed_arrays(unpackable) is None and read_spool_record(spool_line(unpackable))[1] is None


def test_write_calls_is_handed_the_arrays_the_log_line_packed(
    engine: Engine, spool_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From memory and from a replayed log alike, each record comes with its packed arrays, so the writer does not
    pack them again (bench/writer_cpu.py)."""
    handed: dict[str, PackedArrays | None] = {}
    real_write = writer_module.write_calls

    def noting(engine: Engine, records: list[CallRecord], cache: Any, packed: Sequence[PackedArrays | None]) -> None:
        handed.update(zip((record.id for record in records), packed, strict=True))
        real_write(engine, records, cache, packed)

    monkeypatch.setattr(writer_module, "write_calls", noting)
    records = _records(12)
    writer = RecordWriter(engine, spool_dir, queue_size=4, **FAST)  # 8 of them spill to the log
    for record in records:
        writer.submit(record)
    writer.start()
    try:
        assert writer.flush(20)
    finally:
        writer.close()
    assert writer.counters.records_spooled == 8 and sorted(_ids(engine)) == sorted(r.id for r in records)
    assert handed == {record.id: packed_arrays(record) for record in records}


async def test_records_submitted_from_an_event_loop_all_arrive_once(engine: Engine, spool_dir: Path) -> None:
    writer = RecordWriter(engine, spool_dir, **FAST)
    writer.start()
    records = _records(2000)
    for i, record in enumerate(records):
        writer.submit(record)
        if i % 100 == 0:
            await asyncio.sleep(0)
    assert await asyncio.to_thread(writer.flush, 20)
    try:
        assert sorted(_ids(engine)) == sorted(r.id for r in records)
        assert writer.counters.records_written == 2000 and writer.counters.records_spooled == 0 and writer.db_up
        assert writer.counters.records_logged == 2000 and writer.stats().queue_depth == 0
    finally:
        writer.close()
    assert writer.stats().spool_bytes == 0  # every record committed, so the log was removed


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own priority is set only on Linux (the next test)")
def test_writer_nice_lowers_the_writer_thread_alone(engine: Engine, spool_dir: Path) -> None:
    """TRAJGATE_WRITER_NICE renices the writer thread (Linux schedules threads one by one), not the event loop's
    thread nor the process; and the writer still writes."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    writer = RecordWriter(engine, spool_dir, nice=7, **FAST)
    writer.start()
    try:
        records = _records(20)
        for record in records:
            writer.submit(record)
        # Watched, not waited for with flush: a waiter has the relief write (the waiter tests below).
        wait_until(lambda: writer.counters.records_written == 20, 20, "the lowered writer writing the records")
        assert writer._thread is not None and writer._thread.native_id is not None
        assert os.getpriority(os.PRIO_PROCESS, writer._thread.native_id) == min(19, base + 7)
        assert os.getpriority(os.PRIO_PROCESS, 0) == base  # this thread, the event loop's in the gateway
        assert writer._relief is not None and writer._relief.native_id is not None
        assert os.getpriority(os.PRIO_PROCESS, writer._relief.native_id) == base  # the relief keeps the process's
        assert sorted(_ids(engine)) == sorted(r.id for r in records)
        assert writer.counters.relief_turns == 0  # 20 records are no backlog, and nobody waited
    finally:
        writer.close()
    assert not writer._relief.is_alive()  # close wakes it to stop


@LINUX_ONLY
@pytest.mark.parametrize("idle", [True, False])
def test_writer_idle_puts_the_lowered_writer_thread_alone_under_sched_idle(
    engine: Engine, spool_dir: Path, idle: bool
) -> None:
    """TRAJGATE_WRITER_IDLE: the lowered writer thread also runs under SCHED_IDLE, which the kernel preempts as soon as
    the event loop wakes; the event loop's thread and the relief keep the normal policy, and the writer still writes."""
    writer = RecordWriter(engine, spool_dir, nice=7, idle=idle, **FAST)
    writer.start()
    try:
        records = _written(writer, 20)
        assert writer._thread is not None and writer._thread.native_id is not None
        assert writer._relief is not None and writer._relief.native_id is not None
        assert os.sched_getscheduler(writer._thread.native_id) == (os.SCHED_IDLE if idle else os.SCHED_OTHER)
        assert os.sched_getscheduler(writer._relief.native_id) == os.SCHED_OTHER
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # this thread, the event loop's in the gateway
        assert sorted(_ids(engine)) == sorted(r.id for r in records)
    finally:
        writer.close()


def test_a_writer_feeding_a_writer_process_is_not_made_idle(
    engine: Engine, spool_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a writer process the writer thread only feeds it, and has no relief: SCHED_IDLE would leave it next to
    nothing of a saturated core, so it is only reniced."""
    lowered: list[tuple[int, bool]] = []
    monkeypatch.setattr(writer_module, "lower_os_priority", lambda nice, idle=False: lowered.append((nice, idle)))

    class Process:
        def start(self) -> None:
            pass

        def close(self) -> None:
            pass

    writer = RecordWriter(engine, spool_dir, nice=19, idle=True, process=Process(), **FAST)  # type: ignore[arg-type]
    writer.start()
    wait_until(lambda: lowered, 10, "the writer thread's start")
    writer.close()
    assert lowered == [(19, False)]


@LINUX_ONLY
def test_a_writer_at_the_loops_priority_is_not_made_idle() -> None:
    """`idle` goes with a lowered writer: at nice 0 (one writer thread, no relief) it would be the only writer, and a
    saturated core would starve it."""
    seen: list[int] = []

    def run() -> None:
        threads.lower_os_priority(0, idle=True)
        seen.append(os.sched_getscheduler(0))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [os.SCHED_OTHER]


def test_the_gateway_makes_its_lowered_writer_idle_by_default(tmp_path: Path) -> None:
    """The setting reaches the writer the gateway builds: on by default, off with TRAJGATE_WRITER_IDLE=false."""
    for given, expected in (({}, True), ({"writer_idle": False}, False)):
        settings = Settings(database_url="sqlite:///:memory:", spool_dir=tmp_path / str(expected), **given)
        state = build_state(settings)
        try:
            assert state.writer._idle is expected and state.writer._nice == 19
        finally:
            state.engine.dispose()


class _HeldFirstWrite:
    """The writer's first batch held in its write until `go_on` is set, as a core that gives a lowered writer no share
    would hold it; `writers` names the thread of every write."""

    def __init__(self, writer: RecordWriter, monkeypatch: pytest.MonkeyPatch) -> None:
        self.in_batch, self.go_on = threading.Event(), threading.Event()
        self.writers: list[str] = []
        self._writer = writer
        self._write = writer._write
        monkeypatch.setattr(writer, "_write", self.write)

    def submit_behind_the_first(self, records: Sequence[CallRecord]) -> None:
        """Submit the first record, and the rest once the writer holds it in its write."""
        self._writer.submit(records[0])
        assert self.in_batch.wait(10)
        for record in records[1:]:
            self._writer.submit(record)

    def write(
        self, records: Sequence[CallRecord], lines: Sequence[bytes | None], packed: Sequence[PackedArrays | None]
    ) -> bool:
        self.writers.append(threading.current_thread().name)
        if not self.in_batch.is_set():
            self.in_batch.set()
            self.go_on.wait(10)
        return self._write(records, lines, packed)


@pytest.mark.skipif(sys.platform != "linux", reason="a lowered writer and its relief exist only on Linux")
def test_a_backlog_hands_the_lowered_writer_s_loop_to_its_relief(
    engine: Engine, spool_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the lowered writer crawls through a batch (held here in its first write, as on a core that gives it no
    share), records past a quarter of the queue have the relief claim the loop; it writes from the end of that batch
    until less than a batch waits, and every record lands once."""
    writer = RecordWriter(engine, spool_dir, nice=19, queue_size=40, batch_size=4, **FAST)
    held = _HeldFirstWrite(writer, monkeypatch)
    writer.start()
    records = _records(30)
    go_on = held.go_on
    try:
        held.submit_behind_the_first(records)
        wait_until(lambda: writer._baton.claimed, 10, "the relief claiming the loop")
        assert writer.stats().queue_depth == 29 and writer.counters.records_written == 0
        go_on.set()
        assert writer.flush(20)
        assert writer.counters.relief_turns == 1 and writer.counters.records_spooled == 0
        assert held.writers[:2] == ["trajgate-writer", "trajgate-relief"]  # the relief wrote the next batch
        assert writer.counters.records_written == 30 and sorted(_ids(engine)) == sorted(r.id for r in records)
    finally:
        go_on.set()
        writer.close()


@pytest.mark.skipif(sys.platform != "linux", reason="a lowered writer and its relief exist only on Linux")
@pytest.mark.parametrize("waiter", ["flush", "settled"])
def test_a_waiter_hands_the_lowered_writer_s_loop_to_its_relief(
    engine: Engine, spool_dir: Path, monkeypatch: pytest.MonkeyPatch, waiter: str
) -> None:
    """A few records are no backlog, but someone waiting for them (a reward for its trajectory's calls) has the relief
    claim the loop at the end of the lowered writer's batch and write them: a writer on a core other processes keep
    busy would have the reward wait seconds, then answer 404 for a trajectory just answered."""
    writer = RecordWriter(engine, spool_dir, nice=19, queue_size=40, batch_size=4, **FAST)
    held = _HeldFirstWrite(writer, monkeypatch)
    writer.start()
    records = _records(7)  # fewer than `_relieve_at` (10) and than a batch behind the held one: no backlog
    go_on = held.go_on
    try:
        held.submit_behind_the_first(records)
        time.sleep(0.2)
        assert not writer._baton.claimed and writer.counters.relief_turns == 0  # nobody waits yet
        done: list[bool] = []
        wait = (lambda: writer.flush(20)) if waiter == "flush" else (lambda: asyncio.run(writer.settled(20)))
        waiting = threading.Thread(target=lambda: done.append(wait()))
        waiting.start()
        wait_until(lambda: writer._baton.claimed, 10, "the relief claiming the loop for the waiter")
        go_on.set()
        waiting.join(20)
        assert done == [True]
        assert writer.counters.relief_turns == 1
        assert held.writers[0] == "trajgate-writer" and set(held.writers[1:]) == {"trajgate-relief"}
        assert writer.counters.records_written == 7 and sorted(_ids(engine)) == sorted(r.id for r in records)
        wait_until(lambda: not writer._baton.claimed, 10, "the relief handing the loop back once nobody waits")
    finally:
        go_on.set()
        writer.close()


@pytest.mark.skipif(sys.platform != "linux", reason="a lowered writer and its relief exist only on Linux")
def test_the_lowered_writer_gathers_its_batch_out_of_its_turn(
    engine: Engine, spool_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the lowered writer gathers a batch (a long flush interval here) it holds neither the records nor the
    loop: a waiter's relief claims the loop at once and writes them itself. A writer that took them first would keep
    the claim waiting until it got the core back, seconds on a core other processes keep busy."""
    writer = RecordWriter(engine, spool_dir, nice=19, batch_size=4, flush_interval_s=5.0, retry_interval_s=0.1)
    writers: list[str] = []
    write, wait_for_any, stopping_wait = writer._write, writer._queue.wait_for_any, writer._stopping.wait
    waiting, gathering = threading.Event(), threading.Event()

    def named_write(
        records: Sequence[CallRecord], lines: Sequence[bytes | None], packed: Sequence[PackedArrays | None]
    ) -> bool:
        writers.append(threading.current_thread().name)
        return write(records, lines, packed)

    def waits_for_records(timeout_s: float) -> bool:
        waiting.set()  # past the start-up replay
        return wait_for_any(timeout_s)

    def gathers(timeout: float | None = None) -> bool:
        gathering.set()  # it has seen the records and waits for more
        return stopping_wait(timeout)

    monkeypatch.setattr(writer, "_write", named_write)
    monkeypatch.setattr(writer._queue, "wait_for_any", waits_for_records)
    monkeypatch.setattr(writer._stopping, "wait", gathers)
    writer.start()
    try:
        assert waiting.wait(10)
        records = _records(2)  # fewer than a batch: the writer would gather them for up to 5 s, looking every 0.5
        for record in records:
            writer.submit(record)
        assert gathering.wait(10)
        assert writer.flush(10)
        assert writers == ["trajgate-relief"] and writer.counters.relief_turns == 1  # not after the writer's gathering
        assert sorted(_ids(engine)) == sorted(r.id for r in records)
    finally:
        writer.close()


@pytest.mark.skipif(sys.platform != "linux", reason="a lowered writer and its relief exist only on Linux")
def test_closing_a_lowered_writer_drains_its_queue_on_the_relief(
    engine: Engine, spool_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On close (a gateway shutting down) the relief drains what is queued at the process's priority, after the
    batch the lowered writer is in: a shutdown does not wait on a thread a busy core gives no share."""
    writer = RecordWriter(engine, spool_dir, nice=19, queue_size=40, batch_size=4, **FAST)
    held = _HeldFirstWrite(writer, monkeypatch)
    writer.start()
    records = _records(9)  # fewer than `_relieve_at`: no backlog
    go_on, writers = held.go_on, held.writers
    try:
        held.submit_behind_the_first(records)
        closing = threading.Thread(target=writer.close)
        closing.start()
        wait_until(lambda: writer._baton.claimed, 10, "the relief claiming the loop to drain it")
        go_on.set()
        closing.join(30)
        assert not closing.is_alive()
    finally:
        go_on.set()
        writer.close()
    assert writers[0] == "trajgate-writer" and set(writers[1:]) == {"trajgate-relief"}
    assert writer.counters.relief_turns == 0 and writer.counters.records_written == 9
    assert sorted(_ids(engine)) == sorted(r.id for r in records)


def test_the_baton_runs_one_turn_at_a_time_and_a_claim_goes_first() -> None:
    """A claim waits for the turn in progress, and no turn starts while a claim stands: the loop never runs on two
    threads at once."""
    baton = threads.Baton()
    inside: list[str] = []
    leave_turn, leave_claim = threading.Event(), threading.Event()

    def turn(name: str, leave: threading.Event) -> None:
        with baton.turn():
            inside.append(name)
            leave.wait(10)
            inside.remove(name)

    def claim() -> None:
        with baton.claim():
            inside.append("claim")
            assert inside == ["claim"]
            leave_claim.wait(10)
            inside.remove("claim")

    first = threading.Thread(target=turn, args=("first", leave_turn))
    first.start()
    wait_until(lambda: inside == ["first"], 10, "the first turn")
    claiming = threading.Thread(target=claim)
    claiming.start()
    wait_until(lambda: baton.claimed, 10, "the claim")
    no_wait = threading.Event()
    no_wait.set()
    second = threading.Thread(target=turn, args=("second", no_wait))
    second.start()
    assert inside == ["first"]
    leave_turn.set()
    wait_until(lambda: inside == ["claim"], 10, "the claim once the first turn ended")
    assert second.is_alive() and inside == ["claim"]  # no turn while the claim stands
    leave_claim.set()
    claiming.join(10)
    second.join(10)
    first.join(10)
    assert not baton.claimed and inside == [] and not second.is_alive()


def test_off_linux_the_writer_keeps_its_priority_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Elsewhere setpriority takes a process id, which a thread id would name: nothing is reniced, and the log says
    why the setting has no effect."""
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(threads.sys, "platform", "darwin")
    monkeypatch.setattr(threads.os, "setpriority", lambda *args: calls.append(args))
    monkeypatch.setattr(threads.os, "sched_setscheduler", lambda *args: calls.append(args), raising=False)
    with caplog.at_level(logging.WARNING, logger="trajgate.threads"):
        threads.lower_os_priority(19, idle=True)
    assert calls == [] and "only on Linux" in caplog.text


def test_off_linux_a_lowered_writer_has_no_relief(
    engine: Engine, spool_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the writer thread cannot lower its priority, a relief would be a second writer for nothing: none starts,
    and the one writer thread still writes."""
    monkeypatch.setattr(writer_module.sys, "platform", "darwin")
    monkeypatch.setattr(threads.os, "setpriority", lambda *args: pytest.fail("reniced off Linux"))
    writer = RecordWriter(engine, spool_dir, nice=19, **FAST)
    writer.start()
    try:
        records = _written(writer, 5)
        assert writer._relief is None and "trajgate-relief" not in {t.name for t in threading.enumerate()}
        assert sorted(_ids(engine)) == sorted(r.id for r in records)
    finally:
        writer.close()


async def test_database_outage_loses_nothing_and_never_blocks_submit(tmp_path: Path) -> None:
    cluster = PgCluster()
    cluster.start()
    engine = db.make_engine(cluster.url())
    writer = RecordWriter(engine, tmp_path / "spool", **FAST)
    try:
        db.upgrade(cluster.url())
        writer.start()
        records = _records(3000)
        slowest = 0.0
        for i, record in enumerate(records):
            if i == 800:
                stopping = asyncio.create_task(asyncio.to_thread(cluster.stop))
            if i == 1600:
                await stopping
                starting = asyncio.create_task(asyncio.to_thread(cluster.start))
            started = time.perf_counter()
            writer.submit(record)
            slowest = max(slowest, time.perf_counter() - started)
            if i % 20 == 0:
                await asyncio.sleep(0.005)
        await starting

        def all_in() -> bool:
            return writer.db_up and not _segments(tmp_path / "spool") and count_calls(engine) == len(records)

        await asyncio.to_thread(wait_until, all_in, 30, "every record in the database and the spool empty")
        assert sorted(_ids(engine)) == sorted(r.id for r in records)
        assert writer.counters.records_spooled > 0 and writer.counters.write_errors > 0  # the outage really was hit
        # Blocked on the database, a submit would wait out the outage (the cluster's stop and start take seconds);
        # the bound leaves room for a loaded machine's scheduling. How fast submit is lives in bench/, not here.
        assert slowest < 0.25, f"submit took {slowest * 1000:.1f} ms"
    finally:
        writer.close()
        engine.dispose()
        cluster.destroy()


def _live_call_records() -> int:
    return sum(1 for obj in gc.get_objects() if isinstance(obj, CallRecord))


def test_queued_records_past_a_bound_wait_as_their_lines_and_all_are_stored_whole(
    engine: Engine, spool_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past KEEP_RECORDS_BELOW queued, a record waits as its spool line, not a CallRecord with its dicts and lists:
    nothing more for the cyclic garbage collector to walk on the event loop's thread while the writer lags. What the
    writer reads back from a line, and what it was handed whole, is what the database gets, field for field."""
    monkeypatch.setattr(writer_module, "KEEP_RECORDS_BELOW", 10)
    writer = RecordWriter(engine, spool_dir, **FAST)
    request = {"logit_bias": {"50256": -100}, "messages": [{"role": "user", "content": "é"}]}
    usage = {"prompt_tokens": 8, "completion_tokens": 4}
    expected = [
        make_record(f"whole-{i}", 0, seed=i, request=request, usage=usage, latency_ms=1.25 + i) for i in range(40)
    ]
    before = _live_call_records()
    for record in expected:  # not started: every record waits in the queue
        writer.submit(copy.deepcopy(record))
    assert writer.stats().queue_depth == len(expected)
    assert _live_call_records() == before + 10  # the first ten copies are kept, the other thirty are gone
    writer.start()
    try:
        assert writer.flush(20)
        with engine.connect() as conn:
            rows = {row.id: row for row in conn.execute(select(Call))}
        for record in expected:
            row = rows[record.id]
            assert (row.request, row.response, row.usage, row.latency_ms) == (
                record.request, record.response, record.usage, record.latency_ms
            )
            assert decode_ids(row.prompt_token_ids) == record.prompt_token_ids  # each its own root: stored whole
            assert decode_ids(row.completion_token_ids) == record.completion_token_ids
            assert decode_logprobs(row.completion_logprobs) == record.completion_logprobs
    finally:
        writer.close()


def test_full_queue_spills_to_the_spool_and_arrives_later(engine: Engine, spool_dir: Path) -> None:
    writer = RecordWriter(engine, spool_dir, queue_size=10, **FAST)
    records = _records(200)
    for record in records:  # the writer is not started yet: a writer that cannot keep up
        writer.submit(record)
    stats = writer.stats()
    assert stats.queue_depth == 10 and stats.records_spooled == 190 and stats.spool_bytes > 0
    assert not writer.flush(0.05)  # ten records still wait in the queue
    writer.start()
    assert writer.flush(10)
    try:
        assert sorted(_ids(engine)) == sorted(r.id for r in records)
        assert _segments(spool_dir) == []
    finally:
        writer.close()


def test_a_spill_replays_only_the_records_that_left_memory(
    engine: Engine, spool_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spilled record is read back from its own span of the segment: replaying the whole segment rewrote every
    record already committed from memory (under sustained overload, most of the writer's catch-up)."""
    import gateway.recorder.writer as writer_module

    written: list[str] = []
    real_write = writer_module.write_calls

    def counting(engine: Engine, records: list[CallRecord], *rest: Any) -> None:
        real_write(engine, records, *rest)
        written.extend(record.id for record in records)

    monkeypatch.setattr(writer_module, "write_calls", counting)
    writer = RecordWriter(engine, spool_dir, queue_size=30, batch_size=8, **FAST)
    records = _records(200)
    for record in records:  # not started: 30 stay queued, 170 spill, interleaved with nothing else in one segment
        writer.submit(record)
    [segment] = _segments(spool_dir)
    writer.start()
    try:
        assert writer.flush(10)
        assert sorted(written) == sorted(r.id for r in records)  # each once: none of the 30 replayed from the file
        assert writer.counters.records_replayed == 170 and writer.counters.records_spooled == 170
        assert sorted(_ids(engine)) == sorted(r.id for r in records)
        assert not segment.exists() and _segments(spool_dir) == []
    finally:
        writer.close()


def test_a_segment_with_spilled_records_stays_until_its_queued_records_are_committed(
    engine: Engine, spool_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its spilled spans replayed, a segment whose other records are still in memory is kept (they are only safe in
    the file until committed), and removed once they are."""
    import gateway.recorder.writer as writer_module

    gate = threading.Event()
    real_write = writer_module.write_calls
    writer = RecordWriter(engine, spool_dir, queue_size=4, batch_size=4, **FAST)
    records = _records(12)
    for record in records:  # 4 queued, 8 spilled
        writer.submit(record)
    [segment] = _segments(spool_dir)
    writer._spool.rotate()  # closed, as the writer's replay pass would leave it

    def first_batch_waits(engine: Engine, batch: list[CallRecord], *rest: Any) -> None:
        if batch[0].id == records[0].id:  # the queued batch, from memory
            gate.wait(30)
        real_write(engine, batch, *rest)

    monkeypatch.setattr(writer_module, "write_calls", first_batch_waits)
    count = writer._spool.replay(segment, 4, writer._write, lambda: None)  # the 8 spilled, from this thread
    assert count == 8 and segment.exists() and count_calls(engine) == 8
    writer.start()
    try:
        gate.set()
        assert writer.flush(10)
        assert sorted(_ids(engine)) == sorted(r.id for r in records) and not segment.exists()
    finally:
        writer.close()


def test_segments_kept_for_replay_by_span_are_bounded_and_the_rest_replay_whole(
    engine: Engine, spool_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long outage rotates a segment with spilled records every second: past HELD_SPILLED of them the oldest let go
    of their descriptor and are replayed whole, so the process never runs out of descriptors."""
    monkeypatch.setattr("gateway.recorder.spool.HELD_SPILLED", 3)
    writer = RecordWriter(engine, spool_dir, queue_size=1, **FAST)
    records = _records(40)
    for start in range(0, 40, 5):  # 8 segments, each with spilled records (the queue holds the first record only)
        for record in records[start : start + 5]:
            writer.submit(record)
        writer._spool.rotate()

    def open_segments() -> int:
        fds = Path("/proc/self/fd").iterdir()
        return sum(1 for fd in fds if os.path.realpath(fd).startswith(str(spool_dir.resolve()) + "/spool-"))

    assert len(_segments(spool_dir)) == 8 and open_segments() == 3
    writer.start()
    try:
        assert writer.flush(10)
        assert sorted(_ids(engine)) == sorted(r.id for r in records) and _segments(spool_dir) == []
        assert open_segments() == 0
    finally:
        writer.close()


def test_the_queue_is_bounded_by_bytes_too(engine: Engine, spool_dir: Path) -> None:
    """Long agent prompts spill once their spool lines pass the byte bound, however few records are queued; one
    record is always let in; the bytes are released as the writer takes records."""
    line = len(spool_line(_records(1)[0]))
    writer = RecordWriter(engine, spool_dir, queue_size=1000, queue_bytes=3 * line + line // 2, **FAST)
    records = _records(10)
    for record in records:  # not started: nothing leaves the queue
        writer.submit(record)
    stats = writer.stats()
    assert stats.queue_depth == 3 and stats.records_spooled == 7
    assert 3 * line - 10 <= stats.queue_bytes <= 3 * line + 10  # lines differ by a digit or two
    tiny = RecordWriter(engine, spool_dir / "tiny", queue_bytes=1, **FAST)
    tiny.submit(records[0])
    tiny.submit(records[1])
    assert tiny.stats().queue_depth == 1 and tiny.counters.records_spooled == 1
    writer.start()
    tiny.start()
    try:
        assert writer.flush(10) and tiny.flush(10)
        assert sorted(_ids(engine)) == sorted(r.id for r in records)
        assert writer.stats().queue_bytes == 0 and tiny.stats().queue_bytes == 0
    finally:
        writer.close()
        tiny.close()


def test_submit_hands_the_core_to_a_writer_falling_behind(
    engine: Engine, spool_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past two batches queued, each submit yields the CPU once: on a saturated core the event loop would otherwise
    keep the GIL from the writer until the queue filled, and a spilled segment is replayed whole."""
    yields: list[int] = []
    monkeypatch.setattr("gateway.recorder.writer.os.sched_yield", lambda: yields.append(1))
    writer = RecordWriter(engine, spool_dir, queue_size=100, batch_size=4, **FAST)
    for record in _records(12):  # not started: nothing leaves the queue
        writer.submit(record)
    assert len(yields) == 12 - 8  # queue depths 9 to 12 are past 2 x 4
    small = RecordWriter(engine, spool_dir / "small", queue_size=6, batch_size=4, **FAST)
    for record in _records(6):
        small.submit(record)
    assert len(yields) == 4 + 3  # a queue smaller than two batches: past half of it
    writer.start()
    small.start()
    try:
        assert writer.flush(10) and small.flush(10)
    finally:
        writer.close()
        small.close()


def test_start_replays_what_a_previous_process_left(
    engine: Engine, spool_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    records = _records(50)
    # The previous process committed the first ten and crashed before deleting the segment, mid-append.
    write_calls(engine, records[:10])
    spool_dir.mkdir()
    segment = spool_dir / f"spool-{time.time_ns()}-{os.getpid() + 1}.jsonl"
    torn = spool_line(make_record("torn", 0))
    segment.write_bytes(b"".join(spool_line(r) for r in records) + torn[: len(torn) // 2])

    writer = RecordWriter(engine, spool_dir, **FAST)
    with caplog.at_level(logging.WARNING, logger="trajgate.writer"):
        writer.start()
        assert writer.flush(10)
        writer.close()
    assert sorted(_ids(engine)) == sorted(r.id for r in records)
    assert not segment.exists()
    assert "line 51" in caplog.text
    with engine.connect() as conn:
        stored = conn.execute(select(Call.completion_logprobs).where(Call.id == records[20].id)).scalar_one()
    assert decode_logprobs(stored) == records[20].completion_logprobs


def test_a_database_down_from_the_start_spools_until_one_is_there(sqlite_url: str, spool_dir: Path) -> None:
    """The gateway may come up before its database (compose ordering): records wait in the spool."""
    nowhere = db.make_engine(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/postgres")
    writer = RecordWriter(nowhere, spool_dir, **FAST)
    writer.start()
    records = _records(50)
    for record in records:
        writer.submit(record)
    assert writer.flush(5)  # spooled counts as safe while the database is down
    writer.close()
    nowhere.dispose()
    assert not writer.db_up and writer.counters.records_spooled == 50 and writer.counters.records_written == 0
    assert len(_segments(spool_dir)) == 1

    db.upgrade(sqlite_url)
    engine = db.make_engine(sqlite_url)
    successor = RecordWriter(engine, spool_dir, **FAST)
    successor.start()
    successor.close()
    assert sorted(_ids(engine)) == sorted(r.id for r in records) and _segments(spool_dir) == []
    engine.dispose()


def test_close_drains_and_later_submits_wait_in_the_spool(engine: Engine, spool_dir: Path) -> None:
    writer = RecordWriter(engine, spool_dir, **FAST)
    writer.start()
    records = _records(500)
    for record in records:
        writer.submit(record)
    writer.close()
    assert count_calls(engine) == 500 and _segments(spool_dir) == []

    writer.submit(make_record("late", 0))
    writer.close()
    assert writer.counters.records_spooled == 1 and len(_segments(spool_dir)) == 1
    successor = RecordWriter(engine, spool_dir, **FAST)
    successor.start()
    assert successor.flush(10)
    successor.close()
    assert count_calls(engine) == 501 and _segments(spool_dir) == []


def test_a_segment_another_writer_still_appends_to_is_left_alone(sqlite_url: str, tmp_path: Path) -> None:
    """Several gateway processes may share a spool directory; the flock keeps them off each other's segment."""
    db.upgrade(sqlite_url)
    engine = db.make_engine(sqlite_url)
    spool_dir = tmp_path / "spool"
    owner = RecordWriter(engine, spool_dir, queue_size=1, **FAST)  # never started: everything spills
    for record in _records(20):
        owner.submit(record)
    [owned] = _segments(spool_dir)
    # A dead process's segment, newer than the live one: once it is in, the replay pass has passed `owned` by.
    (spool_dir / f"spool-{time.time_ns()}-{os.getpid() + 1}.jsonl").write_bytes(spool_line(make_record("dead", 0)))

    other = RecordWriter(engine, spool_dir, **FAST)
    other.start()
    wait_until(lambda: count_calls(engine) == 1, 10, "the dead writer's segment to be replayed")
    assert owned.exists() and _segments(spool_dir) == [owned]

    owner.close()  # closes and unlocks its segment; the queued record is spooled too
    other.close()  # its final replay pass now takes the segment
    assert count_calls(engine) == 21 and _segments(spool_dir) == []
    engine.dispose()


def test_a_record_the_database_refuses_is_set_aside_without_blocking_the_rest(engine: Engine, spool_dir: Path) -> None:
    writer = RecordWriter(engine, spool_dir, **FAST)
    writer.start()
    good = _records(20)
    bad = make_record("bad", 0, prompt_token_ids=[2**40])  # cannot be stored as int32
    for record in [*good[:10], bad, *good[10:]]:
        writer.submit(record)
    assert writer.flush(10)
    writer.close()
    assert sorted(_ids(engine)) == sorted(r.id for r in good)
    assert writer.counters.records_rejected == 1 and writer.db_up
    [rejected] = (spool_dir / "rejected").iterdir()
    assert read_spool_line(rejected.read_bytes()).id == bad.id
    assert _segments(spool_dir) == []


def test_a_poison_record_is_isolated_without_writing_its_batch_row_by_row(
    engine: Engine, spool_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2 % of requests carrying something the database refuses must not turn every batch into 256 transactions."""
    import gateway.recorder.writer as writer_module

    transactions = []

    def counting(engine: Engine, records: list[CallRecord], *rest: Any) -> None:
        transactions.append(len(records))
        write_calls(engine, records, *rest)

    monkeypatch.setattr(writer_module, "write_calls", counting)
    writer = RecordWriter(engine, spool_dir, batch_size=256, **FAST)
    good = _records(255)
    bad = make_record("bad", 0, prompt_token_ids=[2**40])
    for record in [*good[:100], bad, *good[100:]]:
        writer.submit(record)  # queued before the thread starts: one batch of 256
    writer.start()
    assert writer.flush(10)
    writer.close()
    assert sorted(_ids(engine)) == sorted(r.id for r in good)
    assert writer.counters.records_rejected == 1 and writer.counters.records_written == 255
    assert len(transactions) <= 2 * 8 + 1, transactions  # bisection: two halves per level, log2(256) levels


def test_a_spool_that_cannot_be_opened_keeps_records_in_memory(
    engine: Engine, spool_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EMFILE ("Too many open files") opening the spool is the disk's problem, not the record's: nothing is lost."""
    import gateway.recorder.spool as spool_module

    failures = {"left": 3}
    real_open = spool_module.Spool._open_segment

    def flaky(self: object, capacity: int) -> object:
        if failures["left"]:
            failures["left"] -= 1
            raise OSError(24, "Too many open files")
        return real_open(self, capacity)  # type: ignore[arg-type]

    monkeypatch.setattr(spool_module.Spool, "_open_segment", flaky)
    writer = RecordWriter(engine, spool_dir, queue_size=1, **FAST)
    records = _records(30)
    for record in records:  # the queue holds one; the rest spill, and the spool fails three times
        writer.submit(record)
    assert writer.counters.spool_errors >= 1 and writer.counters.records_lost == 0
    writer.start()
    assert writer.flush(10)
    writer.close()
    assert sorted(_ids(engine)) == sorted(r.id for r in records)
    assert writer.counters.records_lost == 0


def test_replay_counts_what_it_replays_and_what_it_could_not_read(engine: Engine, spool_dir: Path) -> None:
    records = _records(12)
    spool_dir.mkdir()
    segment = spool_dir / f"spool-{time.time_ns()}-{os.getpid() + 1}.jsonl"
    torn = spool_line(make_record("torn", 0))
    segment.write_bytes(b"".join(spool_line(r) for r in records) + b"{not a record\n" + torn[: len(torn) // 2])
    writer = RecordWriter(engine, spool_dir, **FAST)
    writer.start()
    assert writer.flush(10)
    writer.close()
    assert writer.counters.records_replayed == 12 and writer.counters.records_unreadable == 2


@pytest.mark.parametrize("queue_size", [10_000, 7])
def test_a_submitted_record_survives_the_process_being_killed(engine: Engine, spool_dir: Path, queue_size: int) -> None:
    """Once `submit` returns, the record is in the log: a process SIGKILLed before its writer stored anything
    (here: never started) leaves every record for the next start to replay, whole, also those it had spilled (whose
    spans died with it) and those it still held in memory."""
    records = _records(300)
    child = """
import os, signal, sys
from pathlib import Path
from gateway.store.db import make_engine
from gateway.recorder.spool_lines import read_spool_line
from gateway.recorder.writer import RecordWriter
from gateway.runs.settings import Settings
writer = RecordWriter(make_engine("sqlite://"), Path(sys.argv[1]), queue_size=int(sys.argv[2]))
for line in sys.stdin.buffer:
    writer.submit(read_spool_line(line))
os.kill(os.getpid(), signal.SIGKILL)
"""
    done = subprocess.run(
        [sys.executable, "-c", child, str(spool_dir), str(queue_size)],
        input=b"".join(spool_line(r) for r in records),
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])},
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()
    assert count_calls(engine) == 0
    successor = RecordWriter(engine, spool_dir, **FAST)
    successor.start()
    assert successor.flush(20)
    successor.close()
    assert sorted(_ids(engine)) == sorted(r.id for r in records)
    assert successor.counters.records_replayed == 300 and _segments(spool_dir) == []
    # The killed process's untruncated, zero-filled tail is not a record.
    assert successor.counters.records_unreadable == 0


def test_replaying_a_segment_twice_stores_each_call_once(engine: Engine, spool_dir: Path) -> None:
    """A crash between a replay's commit and its delete replays the segment again: upserts keep one row a call."""
    records = _records(40)
    spool_dir.mkdir()
    lines = b"".join(spool_line(r) for r in records)
    (spool_dir / f"spool-{time.time_ns()}-{os.getpid() + 1}.jsonl").write_bytes(lines)
    for _ in range(2):
        writer = RecordWriter(engine, spool_dir, **FAST)
        writer.start()
        assert writer.flush(10)
        writer.close()
        assert writer.counters.records_replayed == 40 and _segments(spool_dir) == []
        (spool_dir / f"spool-{time.time_ns()}-{os.getpid() + 1}.jsonl").write_bytes(lines)  # the same, again
    assert count_calls(engine) == 40 and sorted(_ids(engine)) == sorted(r.id for r in records)


class _Fsyncs:
    """The fsync seam: records what was synced (a segment file, or the spool directory) instead of timing it."""

    def __init__(self) -> None:
        self.synced: list[str] = []

    def __call__(self, fd: int) -> None:
        target = Path(os.readlink(f"/proc/self/fd/{fd}"))
        self.synced.append("dir" if target.is_dir() else target.name)
        os.fsync(fd)

    def take(self) -> list[str]:
        taken, self.synced = self.synced, []
        return taken


def test_group_fsync_syncs_each_segment_once_per_round_and_the_directory_after_it_changes(
    engine: Engine, spool_dir: Path
) -> None:
    fsyncs = _Fsyncs()
    # The interval is far beyond the test, so only the rounds the test runs (`_sync`) happen.
    writer = RecordWriter(engine, spool_dir, fsync_interval_s=3600, segment_age_s=3600, fsync=fsyncs, **FAST)
    for record in _records(50):
        writer.submit(record)
    assert fsyncs.take() == []  # appends never wait for the disk
    [segment] = _segments(spool_dir)
    writer._sync()
    assert fsyncs.take() == [segment.name, "dir"]  # fifty appends, one fsync; the new segment's name made durable
    writer._sync()
    assert fsyncs.take() == []  # nothing new
    writer.submit(make_record("one-more", 0))
    writer._sync()
    assert fsyncs.take() == [segment.name]
    writer.start()
    assert writer.flush(10)
    writer._spool.rotate()  # every record is committed, so rotation removes the segment
    assert _segments(spool_dir) == [] and fsyncs.take() == [segment.name]  # synced as it is closed
    writer._sync()
    assert fsyncs.take() == ["dir"]  # the removal made durable
    writer.close()


def test_fsync_interval_zero_syncs_every_record_before_submit_returns(engine: Engine, spool_dir: Path) -> None:
    fsyncs = _Fsyncs()
    writer = RecordWriter(engine, spool_dir, fsync_interval_s=0, fsync=fsyncs, **FAST)
    writer.submit(make_record("a", 0))
    [segment] = _segments(spool_dir)
    assert fsyncs.take() == [segment.name, "dir"]
    writer.submit(make_record("a", 1))
    assert fsyncs.take() == [segment.name]
    writer.close()


def test_the_sync_thread_waits_the_configured_interval_between_rounds() -> None:
    waits: list[float] = []
    rounds: list[int] = []

    def wait(timeout_s: float) -> bool:
        waits.append(timeout_s)
        return len(waits) == 4  # stopped during the fourth wait

    syncer = Syncer(lambda: rounds.append(len(waits)), 0.025, wait=wait)
    syncer.run()
    assert waits == [0.025] * 4
    assert rounds == [1, 2, 3, 4]  # one round after each interval, and a last one when stopped


def test_committed_segments_are_rotated_and_removed_while_running(engine: Engine, spool_dir: Path) -> None:
    """With a healthy database the log stays short: an old enough segment is closed, and removed once stored."""
    writer = RecordWriter(engine, spool_dir, segment_age_s=0.05, **FAST)
    writer.start()
    try:
        records = _records(60)
        for batch in range(3):
            for record in records[batch * 20 : batch * 20 + 20]:
                writer.submit(record)
            assert writer.flush(10)
            wait_until(lambda: _segments(spool_dir) == [], 10, f"batch {batch}'s segment to be removed")
        counters = writer.counters
        assert count_calls(engine) == 60 and counters.records_spooled == 0 and counters.records_replayed == 0
    finally:
        writer.close()


def test_a_stalled_database_keeps_memory_bounded_and_loses_nothing(engine: Engine, spool_dir: Path) -> None:
    """While writes cannot finish, records beyond the queue live only in the log, and are replayed afterwards."""
    import gateway.recorder.writer as writer_module

    gate = threading.Event()
    real_write = writer_module.write_calls

    def stalled(engine: Engine, records: list[CallRecord], *rest: Any) -> None:
        gate.wait(30)
        real_write(engine, records, *rest)

    writer = RecordWriter(engine, spool_dir, queue_size=50, batch_size=10, **FAST)
    writer_module.write_calls = stalled  # type: ignore[assignment]
    try:
        writer.start()
        records = _records(1000)
        for record in records:
            writer.submit(record)
        assert writer.stats().queue_depth <= 50 and writer.counters.records_spooled >= 1000 - 50 - 10
        gate.set()
        assert writer.flush(30)
    finally:
        writer_module.write_calls = real_write
        writer.close()
    assert sorted(_ids(engine)) == sorted(r.id for r in records) and _segments(spool_dir) == []


def test_a_full_segment_is_closed_and_truncated_off_the_hot_path(engine: Engine, spool_dir: Path) -> None:
    fsyncs = _Fsyncs()
    writer = RecordWriter(engine, spool_dir, segment_bytes=8192, fsync_interval_s=3600, fsync=fsyncs, **FAST)
    records = _records(40)
    for record in records:
        writer.submit(record)
    segments = _segments(spool_dir)
    assert len(segments) > 3 and fsyncs.take() == []  # new segments opened as each filled; nothing synced inline
    writer._sync()  # the sync thread's round: full segments truncated to their records and made durable
    assert set(fsyncs.take()) == {path.name for path in segments} | {"dir"}
    *full, current = segments
    assert all(path.read_bytes().endswith(b"\n") for path in full)  # truncated to whole records
    assert current.read_bytes().endswith(b"\0")  # still preallocated: appends need no system call
    lines = [line for path in segments for line in path.read_bytes().rstrip(b"\0").splitlines(keepends=True)]
    assert sorted(read_spool_line(line).id for line in lines) == sorted(r.id for r in records)
    writer.start()
    assert writer.flush(10)
    writer.close()
    assert sorted(_ids(engine)) == sorted(r.id for r in records) and _segments(spool_dir) == []


def test_replay_stops_at_a_dead_process_s_zero_filled_tail_and_skips_a_torn_record(
    engine: Engine, spool_dir: Path
) -> None:
    records = _records(5)
    torn = spool_line(make_record("torn", 0))
    spool_dir.mkdir()
    segment = spool_dir / f"spool-{time.time_ns()}-{os.getpid() + 1}.jsonl"
    segment.write_bytes(b"".join(spool_line(r) for r in records) + torn[:100] + bytes(65536))
    writer = RecordWriter(engine, spool_dir, **FAST)
    writer.start()
    assert writer.flush(10)
    writer.close()
    assert sorted(_ids(engine)) == sorted(r.id for r in records)
    assert writer.counters.records_replayed == 5 and writer.counters.records_unreadable == 1 and not segment.exists()
