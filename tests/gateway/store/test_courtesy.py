"""gateway.store.courtesy: the writer thread pauses for the event loop at the yield points of its work, only it, only
while few calls are in flight, and for less the further it is behind."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import Engine

from gateway.recorder import writer as writer_module
from gateway.recorder.spool_lines import spool_line
from gateway.recorder.writer import FEW_CALLS_IN_FLIGHT, MIN_PAUSE_S, QUIET_S, RecordWriter
from gateway.store import courtesy
from gateway.store import records as records_module
from gateway.store.call_record import CallRecord
from gateway.store.records import count_calls, write_calls
from tests.support.factories import make_record


class Clock:
    """perf_counter and sleep for gateway.store.courtesy: time moves only when a test says so (or a pause is slept), and
    each pause is noted with the thread that took it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.ticking = False  # a second passes at every read: every yield point reached pauses
        self.pauses: list[tuple[str, float]] = []
        self.lock = threading.Lock()

    def perf_counter(self) -> float:
        if self.ticking:
            self.now += 1
        return self.now

    def sleep(self, seconds: float) -> None:
        with self.lock:
            self.pauses.append((threading.current_thread().name, seconds))
            self.now += seconds


def write_through(writer: RecordWriter, count: int) -> None:
    """Start `writer`, hand it `count` records of their own trajectories, wait for them, close it."""
    writer.start()
    try:
        for i in range(count):
            writer.submit(make_record(f"t{i}", 0, group_id=f"g{i}"))
        assert writer.flush(10)
    finally:
        writer.close()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(courtesy, "time", SimpleNamespace(perf_counter=fake.perf_counter, sleep=fake.sleep))
    return fake


def test_a_thread_pauses_once_per_slice_it_runs_and_only_within_the_block(clock: Clock) -> None:
    with courtesy.giving_way(0.0002, lambda: 0.0001):
        courtesy.give_way()
        clock.now += 0.00015
        courtesy.give_way()
        assert clock.pauses == []  # not a whole slice yet
        clock.now += 0.0001
        courtesy.give_way()
        assert [seconds for _, seconds in clock.pauses] == [0.0001]
        courtesy.give_way()
        assert len(clock.pauses) == 1  # the slice starts again after the pause
        clock.now += 0.0002
        courtesy.give_way()
        assert len(clock.pauses) == 2
    clock.now += 1
    courtesy.give_way()
    assert len(clock.pauses) == 2


def test_other_threads_never_pause(clock: Clock) -> None:
    def other() -> None:
        for _ in range(5):
            clock.now += 1
            courtesy.give_way()

    with courtesy.giving_way(0.0002, lambda: 0.0001):  # this thread only
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert clock.pauses == []
        courtesy.give_way()
        assert len(clock.pauses) == 1


def test_a_slice_of_zero_never_pauses_and_blocks_nest(clock: Clock) -> None:
    with courtesy.giving_way(0.0002, lambda: 0.0001):
        with courtesy.giving_way(0, lambda: 0.0001):
            clock.now += 1
            courtesy.give_way()
            assert clock.pauses == []
        courtesy.give_way()  # the outer block's slice again
        assert len(clock.pauses) == 1


def test_writing_a_batch_passes_a_yield_point_for_each_record(engine: Engine, clock: Clock) -> None:
    """A batch's work per record in write_calls reaches give_way, so a long batch is cut into slices rather than run
    in one stretch."""
    records = [make_record(f"t{i}", 0, group_id=f"g{i}") for i in range(40)]
    clock.ticking = True
    with courtesy.giving_way(0.5, lambda: 0.0001):
        write_calls(engine, records)
    assert count_calls(engine) == 40
    # settling and lineage, the rows and the cache: at least three passes over the batch
    assert len(clock.pauses) >= 3 * len(records)


def test_reading_a_batch_back_from_its_lines_passes_a_yield_point_for_each_line(clock: Clock) -> None:
    """Records past the queue's bound wait as their log lines; a batch of them read back is ~5 ms of the writer's CPU,
    so each line read back is a slice of its own (a record still held is not read)."""
    records = [make_record(f"t{i}", 0, group_id=f"g{i}") for i in range(6)]
    entries = [writer_module._Entry(None, None, 0, spool_line(r), None) for r in records[:5]]
    entries.append(writer_module._Entry(records[5], None, 0, spool_line(records[5]), None))
    clock.ticking = True
    with courtesy.giving_way(0.5, lambda: 0.0001):
        back, _ = writer_module._records(entries)
    assert back == records
    assert len(clock.pauses) == 5


def test_the_batch_document_is_dumped_a_row_at_a_time(clock: Clock) -> None:
    """orjson holds the GIL for a whole dump: the Postgres document of a batch's rows is dumped row by row with a yield
    point before each, and still reads as one JSON array of the rows (NaN and NUL spelled as Postgres takes them)."""
    bulk = records_module._statements("postgresql").calls
    rows = []
    for i in range(5):
        row = dict.fromkeys(bulk.keys)
        row.update(trajectory_id=f"t{i}", seq=0, choice_index=0, response={"text": f"a\x00{i}"})
        rows.append(row)
    float_column = bulk.floats[0]
    rows[2][float_column] = math.nan
    clock.ticking = True
    with courtesy.giving_way(0.5, lambda: 0.0001):
        document = records_module._recordset(bulk, rows)
    assert len(clock.pauses) == len(rows)
    parsed = json.loads(document)
    assert [row["trajectory_id"] for row in parsed] == [f"t{i}" for i in range(5)]
    assert parsed[2][float_column] == "NaN"
    assert all("\x00" not in row["response"]["text"] for row in parsed)


def test_the_writer_thread_pauses_and_the_submitting_thread_does_not(
    engine: Engine, clock: Clock, tmp_path: Path
) -> None:
    clock.ticking = True
    write_through(RecordWriter(engine, tmp_path / "spool", flush_interval_s=0.01, slice_s=0.5, pause_s=0.0003), 20)
    assert count_calls(engine) == 20
    names = {name for name, _ in clock.pauses}
    assert names and threading.current_thread().name not in names
    # the whole pause with nothing queued behind the batch (the last one), less while records were
    assert max(seconds for _, seconds in clock.pauses) == 0.0003
    assert all(0 < seconds <= 0.0003 for _, seconds in clock.pauses)


def test_a_writer_without_a_slice_never_pauses(engine: Engine, clock: Clock, tmp_path: Path) -> None:
    clock.ticking = True
    write_through(RecordWriter(engine, tmp_path / "spool", flush_interval_s=0.01), 20)
    assert count_calls(engine) == 20
    assert clock.pauses == []


def test_a_writer_that_is_behind_pauses_for_a_moment_only(
    engine: Engine, clock: Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pause shortens as records queue behind the batch being written, to a moment at a batch's worth: the writer
    catches up, and still hands the GIL to the event loop at every slice (one that stopped pausing held it for up to
    the interpreter's switch interval at each of the loop's system calls: the c=1 p99)."""
    clock.ticking = True
    batches: list[tuple[int, set[float]]] = []  # (records in the batch, the pauses taken while writing it)

    def noting(engine: Engine, records: list[CallRecord], *rest: Any) -> None:
        before = len(clock.pauses)
        write_calls(engine, records, *rest)
        batches.append((len(records), {seconds for _, seconds in clock.pauses[before:]}))

    monkeypatch.setattr(writer_module, "write_calls", noting)
    writer = RecordWriter(engine, tmp_path / "spool", batch_size=10, flush_interval_s=0.01, slice_s=0.5, pause_s=0.0004)
    for i in range(35):  # before the thread starts: 25, 15, 5 and 0 records wait behind the four batches
        writer.submit(make_record(f"t{i}", 0, group_id=f"g{i}"))
    writer.start()
    try:
        assert writer.flush(10)
    finally:
        writer.close()
    assert count_calls(engine) == 35
    assert [size for size, _ in batches] == [10, 10, 10, 5]
    assert [pauses for _, pauses in batches] == [{MIN_PAUSE_S}, {MIN_PAUSE_S}, {0.0002}, {0.0004}]


def test_the_pause_is_asked_at_the_end_of_each_slice(clock: Clock) -> None:
    """Whether the event loop needs the core changes within one batch: a pause of 0 skips that pause, and the next
    slice's end asks again."""
    asked = iter([0.0, 0.0003, 0.0])
    clock.ticking = True
    with courtesy.giving_way(0.5, lambda: next(asked)):
        for _ in range(3):
            courtesy.give_way()
    assert [seconds for _, seconds in clock.pauses] == [0.0003]

@pytest.mark.parametrize(("in_flight", "pauses"), [(0, True), (FEW_CALLS_IN_FLIGHT, True), (FEW_CALLS_IN_FLIGHT + 1, False)])
def test_a_writer_gives_way_only_while_few_calls_are_in_flight(
    engine: Engine, clock: Clock, tmp_path: Path, in_flight: int, pauses: bool
) -> None:
    """With many calls in flight each mostly waits its turn: there the pauses would only cost throughput."""
    clock.ticking = True
    write_through(
        RecordWriter(engine, tmp_path / "spool", flush_interval_s=0.01, slice_s=0.5, calls_in_flight=lambda: in_flight),
        10,
    )
    assert count_calls(engine) == 10
    assert bool(clock.pauses) is pauses


@pytest.mark.parametrize(
    ("in_flight", "quiet_for", "pauses"), [(0, QUIET_S, False), (0, QUIET_S / 2, True), (1, 10 * QUIET_S, True)]
)
def test_a_writer_does_not_give_way_to_a_quiet_gateway(
    engine: Engine, clock: Clock, tmp_path: Path, in_flight: int, quiet_for: float, pauses: bool
) -> None:
    """No call in flight and none started or ended for QUIET_S: a writer catching up has nobody to give way to. A call
    in flight, or one that just ended (an agent's next turn follows), still gets the pauses."""
    clock.ticking = True
    writer = RecordWriter(
        engine,
        tmp_path / "spool",
        flush_interval_s=0.01,
        slice_s=0.5,
        calls_in_flight=lambda: in_flight,
        quiet_for=lambda: quiet_for,
    )
    write_through(writer, 10)
    assert count_calls(engine) == 10
    assert bool(clock.pauses) is pauses
