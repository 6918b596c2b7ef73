"""The record writer: the only way captured calls reach the database.

The response path must never wait on the database, and an answered call must survive a crash whatever the database
is doing. So `submit` first appends the record to the spool (gateway.recorder.spool, the write-ahead log on disk),
then puts it on a bounded in-memory queue; one background thread, here, writes the queue to the database in batches
and tells the spool which records are committed, so it can remove their segment. Records the queue has no room for,
and batches the database cannot take while it is away, are dropped from memory (so memory stays bounded) and stored
later by replaying the spool, as is whatever a killed process left. Every write is an idempotent upsert (see
gateway.store.records), which is what makes replaying a record that was already stored harmless. With
TRAJGATE_WRITER_PROCESS the thread hands each batch's database work to a process of its own
(gateway.recorder.writer_process) and waits without the GIL; everything else stays here. With TRAJGATE_WRITER_NICE
the thread runs at a lower OS priority, and a second thread of normal priority takes its loop over while records pile
up (`_relieve`). Records that can never be written (the database rejects their data) go to `rejected/` in the spool
directory for an operator to inspect.

What the writer has done is counted in one `WriterCounters`, which `stats` hands out as a snapshot with where it
stands (queue depth, spool bytes, database up): /metrics reads that, nothing copies the fields one by one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import NamedTuple

from sqlalchemy import Engine

from gateway.recorder.spool import Segment, Spool, Syncer
from gateway.recorder.spool_lines import (
    is_record_error,
    packed_arrays,
    read_spool_line,
    read_spool_record,
    reason,
    spool_line,
)
from gateway.recorder.threads import Baton, lower_os_priority, name_os_thread
from gateway.recorder.writer_process import WriterProcess
from gateway.store.arrays import PackedArrays
from gateway.store.call_record import CallRecord
from gateway.store.courtesy import give_way, giving_way
from gateway.store.records import LineageCache, ping, write_calls

log = logging.getLogger("trajgate.writer")

_DRAINS_PER_FLUSH = 10  # how often per flush interval the writer looks for more records once a batch has begun



@dataclass
class WriterCounters:
    """What the writer has done since it started, record by record: every field only grows. One object, changed only
    under the writer's lock (the event loop and the writer thread both count, and `+=` on an attribute is not
    atomic), so a reader takes a consistent copy through `RecordWriter.stats` instead of reading fields one by one."""

    records_logged: int = 0  # appended to the spool before their answer completed
    records_unlogged: int = 0  # answered without a copy on disk (the log failed): a crash would lose them
    records_written: int = 0
    records_spooled: int = 0  # dropped from memory, so stored by replaying the log
    records_rejected: int = 0  # refused by the database, kept in rejected/
    records_lost: int = 0  # neither stored nor kept on disk
    records_replayed: int = 0
    records_unreadable: int = 0  # spool lines replay could not read (a torn append): lost, usually at start-up
    spool_errors: int = 0
    sync_errors: int = 0
    write_errors: int = 0
    relief_turns: int = 0  # times a backlog or a waiter had the normal-priority thread take the loop over (_relieve)

    def add(self, other: WriterCounters) -> None:
        """Add `other`'s counts to these (the caller holds the writer's lock)."""
        for field in fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))


@dataclass
class WriterStats(WriterCounters):
    """A snapshot of the writer for /metrics: its counters (a copy), and where it stands now. Flat, so
    `dataclasses.asdict` of it is what the metrics collector reads, by these field names."""

    queue_depth: int = 0  # records waiting in memory
    queue_bytes: int = 0  # their spool lines' bytes (what TRAJGATE_WRITER_QUEUE_BYTES bounds)
    spool_bytes: int = 0  # bytes in the spool not known stored
    records_held: int = 0  # kept in memory because the spool could not be written
    syncs: int = 0  # group fsyncs of the spool
    db_up: bool = True


# At most this many calls in flight, the writer gives way to the event loop (RecordWriter._pause).
FEW_CALLS_IN_FLIGHT = 4
# With none in flight for this long, the gateway is quiet and the writer stops giving way (RecordWriter._pause).
QUIET_S = 0.1
# The shortest pause: asleep at all, the thread hands the GIL and the core to the event loop (the kernel's timer slack
# makes it ~50 µs); a sleep of 0 would take the GIL straight back.
MIN_PAUSE_S = 0.000_001
# A queued record keeps its objects while fewer records than this wait, and is its log line alone past it (`_Entry`).
# A call's record is nine objects the collector tracks: 512 of them stay under half the young generation's threshold
# (gateway.cli.GC_THRESHOLDS), so records waiting for the writer do not start collections by themselves.
KEEP_RECORDS_BELOW = 512


class _Entry(NamedTuple):
    """A record on its way to the database, and where the log holds it.

    Past `KEEP_RECORDS_BELOW` queued, an entry holds the line (bytes) and not the record, which the writer thread
    reads back from the line when it takes the batch (`_records`), as replay does. A record's dicts and id lists are
    objects the cyclic garbage collector tracks: while thousands waited behind a writer that gets the core only when
    the event loop leaves it, each young collection on the loop's thread walked them all (3-13 ms at c=1 on
    bench/gateway_overhead.py) and older ones walked them again. Bytes are not tracked. Below the bound the record is
    kept, and the writer does not read it back (~18 µs a call): over seven runs of bench/gateway_overhead.py each, CPU
    per request at c=64 went from 1.19x the thin proxy's to 1.10x (medians), c=1 and s=1 p99 no worse. Keeping every
    record while many calls are in flight was worse (1.22x): at c=64 the queue fills, and ~10,000 records is 90,000
    objects for the collector."""

    record: CallRecord | None  # None: the line holds it
    segment: Segment | None  # None: not logged
    offset: int  # of its line in the segment
    line: bytes | None  # None: it could not be made
    # its arrays, packed for the line and handed to write_calls; None: not packed, or read back with the line
    packed: PackedArrays | None


class _Queue(queue.Queue[_Entry]):
    """The writer's queue, which can also be waited on without taking anything (`RecordWriter._await_batch`)."""

    def wait_for_any(self, timeout_s: float) -> bool:
        """Whether an entry is queued, waiting up to `timeout_s` for one."""
        with self.not_empty:
            return bool(self.not_empty.wait_for(self._qsize, timeout_s))


def _records(batch: Sequence[_Entry]) -> tuple[list[CallRecord], list[PackedArrays | None]]:
    """The batch's records and packed arrays, read back from their lines where the entries hold only those. A yield
    point before each line read back (gateway.store.courtesy): a batch of 256 is ~5 ms of the writer's CPU, which
    without one a call arriving at c=1 waited out for the GIL."""
    records: list[CallRecord] = []
    packed: list[PackedArrays | None] = []
    for entry in batch:
        if entry.record is not None:
            records.append(entry.record)
            packed.append(entry.packed)
        else:
            assert entry.line is not None  # an entry without a record is one whose line was made
            give_way()
            record, arrays = read_spool_record(entry.line)
            records.append(record)
            packed.append(arrays)
    return records, packed


class RecordWriter:
    """Logs every record to the spool before its answer completes, then batches records from memory into the
    database on one background thread, so that no answered call is lost, even to a crash, and `submit` never
    waits on the database."""

    def __init__(
        self,
        engine: Engine,
        spool_dir: Path,
        queue_size: int = 10_000,
        batch_size: int = 256,
        queue_bytes: int = 128 * 1024 * 1024,
        flush_interval_s: float = 0.05,
        retry_interval_s: float = 1.0,
        fsync_interval_s: float = 0.01,
        segment_bytes: int = 16 * 1024 * 1024,
        segment_age_s: float = 1.0,
        fsync: Callable[[int], None] = os.fsync,
        process: WriterProcess | None = None,
        slice_s: float = 0.0,
        pause_s: float = 0.0001,
        calls_in_flight: Callable[[], int] = lambda: 0,
        quiet_for: Callable[[], float] = lambda: 0.0,
        nice: int = 0,
        idle: bool = False,
    ) -> None:
        self._engine = engine
        # How much lower the writer thread's OS priority is than the event loop's (`lower_os_priority`). On the event
        # loop's core the scheduler (Linux's EEVDF) does not always let the loop, woken by a call's bytes, take the
        # core from a writer thread of equal priority that is writing a batch: at c=1 and s=1 that was most of the
        # milliseconds the slowest 1 % of calls lost (bench/README.md). At 19 the loop always goes first, and a
        # writer on a saturated core gets little of it: the relief thread writes then.
        self._nice = nice
        # With `nice`, also SCHED_IDLE (`lower_os_priority`): preempted at once when the loop wakes.
        self._idle = idle
        # The batch loop runs on one thread at a time (`Baton`): the writer thread, and with `nice` its relief, which
        # keeps the process's priority and takes the loop over while records pile up (`_relieve`): at nice 19 the
        # writer gets little of a saturated core, and the database would fall ever further behind the answers.
        self._baton = Baton()
        self._relief: threading.Thread | None = None
        self._backlog = threading.Event()  # set by `submit` when records pile up, by a waiter (`_lift`), by `close`
        # How the writer thread shares the event loop's core: it pauses for up to `pause_s` after each `slice_s` of
        # writing a batch from the queue (gateway.store.courtesy, `_pause`); a slice of 0 never pauses.
        self._slice_s = slice_s
        self._pause_s = pause_s
        self._calls_in_flight = calls_in_flight
        self._quiet_for = quiet_for  # seconds since a call last ended (read with none in flight)
        self._process = process  # where batches are written; None: on the writer thread itself
        self._spool = Spool(Path(spool_dir), segment_bytes, sync_each=fsync_interval_s == 0, fsync=fsync)
        self._syncer = Syncer(self._sync, fsync_interval_s) if fsync_interval_s > 0 else None
        self._queue: _Queue = _Queue(maxsize=queue_size)
        # The queue is also bounded by its records' spool lines' bytes: a count alone lets agents' long prompts fill
        # gigabytes before anything spills (an entry that keeps its record, `_Entry`, holds ~5x its line: a 30k-token
        # prompt is ~1 MB as Python ints).
        self._queue_bytes = queue_bytes
        self._queued_bytes = 0  # under `_cond`
        self._batch_size = batch_size
        # Past this many queued records the writer is falling behind (gateway.recorder.writer: `submit`).
        self._behind = min(2 * batch_size, queue_size // 2)
        # Past this many, or a quarter of the queue's bytes, a lowered writer thread is relieved (`_relieve`). Not at
        # `_behind`: a writer at nice 19 lags that far at c=1 while the client shares its core, and the relief's
        # normal priority would bring back the latency the lowering took away.
        self._relieve_at = max(batch_size, queue_size // 4)
        self._flush_interval_s = flush_interval_s
        self._retry_interval_s = retry_interval_s
        self._segment_age_s = segment_age_s
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        # Guards the counters below and `_closed`; flush() waits on it for progress.
        self._cond = threading.Condition()
        self._closed = False
        self._submitted = 0
        self._settled = 0  # taken off the hot path: written, dropped to the log, rejected or lost
        self._lift_until = 0  # the relief keeps the loop until this many are settled: someone waits for them (`_lift`)
        self._inflight: Sequence[_Entry] = ()
        # Records the log could not take (EMFILE, a full disk) and the database could not either: kept in memory and
        # retried from the writer thread, because a failing disk says nothing about the records themselves.
        self._held: deque[CallRecord] = deque()
        self._next_held_retry = 0.0
        self._next_ping = 0.0
        self._next_spill_replay = 0.0
        self._spilling = False
        self._log_failing = False
        self.db_up = True
        self.counters = WriterCounters()  # changed only under `_cond`
        # Owned here, handed to every batch: the newest call per trajectory this process wrote (gateway.store.records).
        self.lineage = LineageCache()

    # --- the hot path -------------------------------------------------------------------------------------------

    def submit(self, record: CallRecord) -> None:
        """Append the record to the log (so it survives a crash once this returns), then hand it to the writer
        thread without waiting: the queue if it has room; if not, the logged copy is all there is until replay.

        Past two batches queued the writer is falling behind, and the caller yields the CPU once (`os.sched_yield`,
        the GIL released). On a saturated core the event loop otherwise keeps the GIL: a thread it hands the GIL to
        in a system call cannot run before the loop has taken it back, so the writer got the GIL only by forcing a
        switch (5 ms) after each of its database round trips, fell behind at c=64 until the queue spilled (bench/README.md,
        "the writer under saturation")."""
        entry = self._log(record)
        queued = False
        with self._cond:
            self._submitted += 1
            self.counters.records_logged += int(entry.segment is not None)
            closed = self._closed
            size = len(entry.line) if entry.line is not None else 0
            # One record is always let in (an empty queue takes even one past the bound).
            if not closed and (self._queued_bytes + size <= self._queue_bytes or self._queued_bytes == 0):
                try:
                    self._queue.put_nowait(entry)
                    queued = True
                    self._queued_bytes += size
                except queue.Full:
                    pass
            queued_bytes = self._queued_bytes
        relief = self._relief is not None and not self._backlog.is_set()
        if queued:
            depth = self._queue.qsize()
            if relief and (depth >= self._relieve_at or 4 * queued_bytes > self._queue_bytes or self._busy(depth)):
                self._backlog.set()
            if depth > self._behind:
                os.sched_yield()
            return
        if relief:
            self._backlog.set()
        if not self._spilling:
            self._spilling = True
            if closed:
                log.warning("record submitted after the writer closed; it waits in the spool for the next start")
            else:
                log.warning(
                    "writer queue full (%d records, %d bytes of spool lines at most); the spool keeps the rest",
                    self._queue.maxsize,
                    self._queue_bytes,
                )
        self._drop([entry])
        self._settle(1)

    def _busy(self, depth: int) -> bool:
        """Falling behind with many calls in flight: each call mostly waits its turn there anyway, so the relief
        writes at once, rather than after the lowered writer's batch has crawled through a saturated core."""
        return depth > self._behind and self._calls_in_flight() > FEW_CALLS_IN_FLIGHT

    def _log(self, record: CallRecord) -> _Entry:
        """Append one record to the log: its entry, whose segment is None (never an exception) if it could not be."""
        try:
            packed = packed_arrays(record)
            line = spool_line(record, packed)
        except Exception as exc:  # whatever the record holds, submit must not raise
            log.error("cannot log call %s: %s", record.id, exc)
            self._count(WriterCounters(records_unlogged=1))
            return _Entry(record, None, 0, None, None)
        # Past KEEP_RECORDS_BELOW queued, the line stands for the record from here on (`_Entry`). A writer process's
        # entries keep it: the thread feeding it sends lines and would read records back only to set one aside.
        keep = self._process is not None or self._queue.qsize() < KEEP_RECORDS_BELOW
        kept, kept_packed = (record, packed) if keep else (None, None)
        try:
            segment, offset = self._spool.append(line, 1)
        except Exception as exc:  # OSError (EMFILE, a full disk) or anything else: the call is answered regardless
            if not self._log_failing:  # once per episode, not once per record while the disk keeps failing
                self._log_failing = True
                log.error("spool append failed; records are kept in memory only until it works again: %s", exc)
            self._count(WriterCounters(records_unlogged=1, spool_errors=1))
            return _Entry(kept, None, 0, line, kept_packed)
        self._log_failing = False
        return _Entry(kept, segment, offset, line, kept_packed)

    # --- lifecycle ----------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the writer thread, which first replays what a previous process left in the spool, the
        group-fsync thread, and with a lowered writer (`nice`, on Linux) its relief."""
        if self._thread is None:
            # A writer process takes the database work off the thread, and its own priority with it: no relief then.
            if self._nice > 0 and sys.platform == "linux" and self._process is None:
                self._relief = threading.Thread(target=self._relieve, name="trajgate-relief", daemon=True)
                self._relief.start()
            self._thread = threading.Thread(target=self._run, name="trajgate-writer", daemon=True)
            self._thread.start()
            if self._syncer is not None:
                self._syncer.start()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every record submitted so far is in the database, or safely in the log while the database is
        down. False on timeout (for instance under sustained overload, when the log never empties)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            target = self._submitted
            if not self._flushed_locked(target):
                self._lift(target)
            while not self._flushed_locked(target):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, self._retry_interval_s))
        return True

    async def settled(self, timeout_s: float = 10.0) -> bool:
        """`flush` for the event loop: polls instead of holding a thread, so a burst of rewards waiting for their
        calls' records cannot take every database thread from the reads queued behind them."""
        with self._cond:
            target = self._submitted
            if not self._flushed_locked(target):
                self._lift(target)
        deadline = time.monotonic() + timeout_s
        delay = 0.001
        while True:
            with self._cond:
                if self._flushed_locked(target):
                    return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    def mark(self) -> int:
        """A point in the stream of submitted records, for `reached`: every record submitted before this call."""
        with self._cond:
            return self._submitted

    def reached(self, mark: int) -> bool:
        """Whether every record submitted before `mark` was taken is in the database (or safely in the log while
        the database is down): `flush` without waiting, for a caller that polls anyway (gateway/recorder/heartbeat.py)."""
        with self._cond:
            return self._flushed_locked(mark)

    def _flushed_locked(self, target: int) -> bool:
        return self._settled >= target and not self._held and not (self.db_up and self._spool.pending)

    def _lift(self, target: int) -> None:
        """Someone waits for the records submitted before `target` (a reward for its trajectory's calls): a lowered
        writer's relief writes them at the process's priority. Without it, a writer under SCHED_IDLE on a core that
        other processes keep busy (a vLLM on the same machine, a client) got so little of it that five records took
        1.4-2.4 s to store beside one busy process and 4.9-7.2 s beside three (a 2-core AMD EPYC), while a reward
        then waited 5 s for them and answered 404 for a trajectory that was just answered. Called under `_cond`."""
        self._lift_until = max(self._lift_until, target)
        if self._relief is not None:
            self._backlog.set()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop accepting (later submits only go to the log), drain the queue, replay the log once more if the
        database is up, and close the log. Whatever the thread cannot finish in time stays in the log.
        Calling it again only closes the segment that submits after the first close appended to."""
        with self._cond:
            already_closed, self._closed = self._closed, True
        if already_closed:
            self._spool.rotate()
            self._spool.close_all()
            return
        self._stopping.set()
        self._backlog.set()  # wakes the relief to see the writer stopping
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        if self._relief is not None:
            self._relief.join(timeout_s)
        if thread is None or thread.is_alive():
            if thread is not None:
                log.error("writer still busy %.0f s after close; leaving what it holds in the spool", timeout_s)
            # Duplicates of the in-flight batch are harmless: every write is an upsert.
            leftovers = list(self._inflight) + self._take_all()
            if leftovers:
                self._drop(leftovers, keep=False)
                self._settle(len(leftovers))
        held = self._take_held(len(self._held))
        if held:  # the last chance to keep them: a log that fails now loses them
            self._drop([_Entry(record, None, 0, None, None) for record in held], keep=False)
            self._settle(len(held))
        self._spool.rotate()
        if self._syncer is not None:
            self._syncer.stop()
        self._spool.close_all()
        if self._process is not None:
            self._process.close()

    # --- counters -----------------------------------------------------------------------------------------------

    def stats(self) -> WriterStats:
        """The counters (a consistent copy) and where the writer stands now: what /metrics reads at scrape time."""
        with self._cond:
            counters = asdict(self.counters)
            held = len(self._held)
            queued_bytes = self._queued_bytes
        return WriterStats(
            **counters,
            queue_depth=self._queue.qsize(),
            queue_bytes=queued_bytes,
            spool_bytes=self._spool.size_bytes(),
            records_held=held,
            syncs=self._spool.syncs,
            db_up=self.db_up,
        )

    # --- the group-fsync thread ---------------------------------------------------------------------------------

    def _sync(self) -> None:
        try:
            self._spool.sync()
        except OSError as exc:
            self._count(WriterCounters(sync_errors=1))
            log.error("fsync of the spool failed (appended records are safe from a crash, not power loss): %s", exc)

    # --- the writer thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        name_os_thread()
        # Not SCHED_IDLE with a writer process: this thread then feeds it with no relief, and an idle thread would get
        # next to nothing of a saturated core.
        lower_os_priority(self._nice, self._idle and self._process is None)
        if self._process is not None:
            try:
                self._process.start()
            except OSError as exc:  # tried again with the first batch; until then records wait in the queue and log
                log.error("cannot start the writer process: %s", exc)
        with self._baton.turn():
            self._replay_spool()
        going = True
        while going:
            self._await_batch()  # out of the turn: a relief claiming the loop meanwhile gets it at once
            with self._baton.turn():
                going = self._step(gather=False)
        with self._baton.turn():
            if self.db_up:
                self._replay_spool()
            self._spool.rotate()

    def _relieve(self) -> None:
        """The relief of a writer thread running at a lower OS priority: it keeps the process's priority, sleeps until
        `submit` sees records pile up (`_relieve_at` records or a quarter of the queue's bytes queued, the queue full,
        or two batches queued with many calls in flight) or someone waits for records (`_lift`), then takes the loop
        over from the end of the writer's batch until less than a batch waits, nothing has spilled, few calls are in
        flight and nobody waits, and hands it back; on `close` it drains the queue. At nice 19 the writer took c=1's
        added p99 from +2.3 to +0.9 ms on a 2-core AMD EPYC, and on a saturated core got 9 µs a request against the 57
        it needs (bench/README.md): the relief writes then."""
        name_os_thread()
        while True:
            self._backlog.wait()
            with self._baton.claim():
                if not self._stopping.is_set():
                    self._count(WriterCounters(relief_turns=1))
                self._relief_turn()
            if self._stopping.is_set():
                return

    def _relief_turn(self) -> None:
        """Write while behind (or, closing, until the queue is empty). The backlog event is cleared only once the
        relief has caught up, then looked at once more: a waiter or a backlog that set it between the last look and the
        clear would otherwise wait on the lowered writer."""
        while True:
            while self._stopping.is_set() or self._behind_still():
                if not self._step():  # stopping, and the queue is empty
                    return
            self._backlog.clear()
            if not self._behind_still():
                return

    def _behind_still(self) -> bool:
        """Whether the relief keeps the loop: a batch or more waits, records spilled, many calls are in flight, or
        someone waits for records not yet settled (`_lift`)."""
        return (
            self._queue.qsize() >= self._batch_size
            or self._spilling
            or self._calls_in_flight() > FEW_CALLS_IN_FLIGHT
            or self._awaited()
        )

    def _step(self, gather: bool = True) -> bool:
        """One turn of the batch loop: the next batch written (or dropped to the log while the database is down), the
        log rotated and replayed when due. False once the writer is stopping and the queue is empty. Without `gather`,
        the batch is what waits now: the writer thread gathered it out of its turn (`_await_batch`)."""
        try:
            if gather:
                self._await_batch()
            batch = self._next_batch()
            if batch:
                self._inflight = batch
                with giving_way(self._slice_s, self._pause):
                    records, packed = _records(batch)
                    written = self.db_up and self._write(records, [entry.line for entry in batch], packed)
                if written:
                    self._committed(batch)
                else:
                    self._drop(batch)
                self._inflight = ()
                self._settle(len(batch))
            elif self._stopping.is_set():
                return False
            self._spool.rotate_if_due(self._segment_age_s)
            self._recover_or_replay()
        except Exception:
            # Never let the loop die: everything after it would sit in the queue and then spill.
            log.exception("unexpected error in the writer thread")
            time.sleep(self._retry_interval_s)
        return True

    def _pause(self) -> float:
        """How long the writer pauses for the event loop at the end of a slice (gateway.store.courtesy), asked at each
        slice's end. Only while few calls are in flight, where a stretch of the writer's work is a call's delay: with
        many, each call mostly waits its turn anyway, and the pauses' cost (a sleep, the GIL handed back and forth)
        would come out of the gateway's throughput. The pause shortens as records queue behind the batch, to a
        moment (`MIN_PAUSE_S`) at a batch's worth: a writer that falls behind at low concurrency still hands the GIL
        over at every slice, where one that stopped pausing held it for up to the interpreter's switch interval (5 ms)
        at each of the event loop's system calls, and one that kept the whole pause fell further behind.

        Nor while the gateway is quiet (no call in flight, none started or ended for `QUIET_S`): a writer catching up
        after a burst then has nobody to give way to, and each pause cost it ~10 µs of CPU and ~50 µs of waiting a
        slice: a catch-up took 20-27 % less CPU without them (bench/writer_cpu.py --spill). The first call after the
        quiet spell may wait for the GIL up to the switch interval, once: it ends the spell."""
        in_flight = self._calls_in_flight()
        if in_flight > FEW_CALLS_IN_FLIGHT or (in_flight == 0 and self._quiet_for() >= QUIET_S):
            return 0.0
        behind = min(1.0, self._queue.qsize() / self._batch_size)
        return max(MIN_PAUSE_S, self._pause_s * (1.0 - behind))

    def _await_batch(self) -> None:
        """Wait, taking nothing, until a batch is worth taking: a batch's worth queued, the flush interval passed since
        the first record came, someone waiting for records (`_awaited`: five records a waiter waited for were stored
        in 4-13 ms where gathering took 55-60), or the writer stopping; a flush interval at most when nothing comes
        (the turn then rotates and replays the log when due). The queue is looked at a few times per flush interval,
        not at each record: every wake-up takes the GIL from the event loop for a moment (two context switches when
        both share a core), and under load that happened once per answered call.

        The writer thread waits out of its turn, so a relief claiming the loop meanwhile (a waiter, a backlog) gets it
        at once and writes these very records. A writer under SCHED_IDLE that took them first and waited in its turn
        had to get the core back after each wait before the turn could end: beside three busy processes on its core,
        five records a waiter had claimed the loop for still took 2.7-6.9 s (a 2-core AMD EPYC)."""
        if not self._queue.wait_for_any(self._flush_interval_s):
            return
        deadline = time.monotonic() + self._flush_interval_s
        while self._queue.qsize() < self._batch_size and not self._stopping.is_set() and not self._awaited():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._stopping.wait(min(remaining, self._flush_interval_s / _DRAINS_PER_FLUSH))

    def _awaited(self) -> bool:
        """Whether someone waits for records not yet settled (`_lift`): then a batch is written as it stands, not
        gathered for the rest of the flush interval."""
        return self._settled < self._lift_until

    def _next_batch(self) -> list[_Entry]:
        """Held records when their retry is due, else up to a batch of what is queued now."""
        if self._held and not self._stopping.is_set() and time.monotonic() >= self._next_held_retry:
            return [_Entry(record, None, 0, None, None) for record in self._take_held(self._batch_size)]
        batch: list[_Entry] = []
        while len(batch) < self._batch_size:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        self._dequeued(batch)
        return batch

    def _take_held(self, limit: int) -> list[CallRecord]:
        records: list[CallRecord] = []
        while self._held and len(records) < limit:
            records.append(self._held.popleft())
        return records

    def _take_all(self) -> list[_Entry]:
        entries = []
        while True:
            try:
                entries.append(self._queue.get_nowait())
            except queue.Empty:
                self._dequeued(entries)
                return entries

    def _dequeued(self, entries: Sequence[_Entry]) -> None:
        """Entries taken off the queue: their bytes no longer count against its bound."""
        size = sum(len(entry.line) for entry in entries if entry.line is not None)
        with self._cond:
            self._queued_bytes -= size

    def _committed(self, entries: Sequence[_Entry]) -> None:
        """Count stored records against their segments, so fully committed segments can be removed."""
        per_segment: dict[Segment, int] = {}
        for entry in entries:
            if entry.segment is not None:
                per_segment[entry.segment] = per_segment.get(entry.segment, 0) + 1
        for segment, count in per_segment.items():
            self._spool.commit(segment, count)

    def _recover_or_replay(self) -> None:
        """While down, poll the database every retry interval and replay the log once it answers; while up,
        replay records that were dropped from memory because the queue was full, when the queue has gone quiet (or
        every retry interval under sustained load, so the log cannot grow forever)."""
        now = time.monotonic()
        if not self.db_up:
            if now < self._next_ping:
                return
            self._next_ping = now + self._retry_interval_s
            if not ping(self._engine):
                return
        elif not (self._spool.pending and (self._queue.empty() or now >= self._next_spill_replay)):
            return
        self._next_spill_replay = now + self._retry_interval_s
        if self._replay_spool():
            self._spilling = False
            if not self.db_up:
                log.info("database reachable again; writing directly")
                self._set_db_up(True)

    def _replay_spool(self) -> bool:
        """Write every closed segment not committed from memory, oldest first, removing each once committed. False
        if the database failed part-way; the remaining segments stay for the next attempt."""
        if self._spool.current_dropped:
            self._spool.rotate()  # never replay the segment still being appended to
        replayed = 0
        try:
            for path in self._spool.segments():
                count = self._spool.replay(path, self._batch_size, self._write, self._count_unreadable)
                if count is None:
                    return False
                self._count(WriterCounters(records_replayed=count))
                replayed += count
            return True
        finally:
            with self._cond:
                self._cond.notify_all()
            if replayed:
                log.info("replayed %d spooled records into the database", replayed)

    def _write(
        self, records: Sequence[CallRecord], lines: Sequence[bytes | None], packed: Sequence[PackedArrays | None]
    ) -> bool:
        """Upsert one batch (`lines`, `packed`: the records' spool lines and packed arrays, where known); True once
        every record is in the database (or rejected), False if it is down."""
        try:
            self._store(records, lines, packed)
        except Exception as exc:
            self._count(WriterCounters(write_errors=1))
            if not is_record_error(exc):
                self._mark_down(exc)
                return False
            return self._isolate(records, lines, packed, exc)
        self._count(WriterCounters(records_written=len(records)))
        return True

    def _store(
        self, records: Sequence[CallRecord], lines: Sequence[bytes | None], packed: Sequence[PackedArrays | None]
    ) -> None:
        if self._process is None:
            write_calls(self._engine, records, self.lineage, packed)
            return
        # Lines the hot path made are sent as they are; a record held in memory or replayed without one gets its own.
        self._process.write([spool_line(record) if line is None else line for record, line in zip(records, lines)])

    def _isolate(
        self,
        records: Sequence[CallRecord],
        lines: Sequence[bytes | None],
        packed: Sequence[PackedArrays | None],
        exc: BaseException,
    ) -> bool:
        """Set aside the records the database refuses (so one cannot block the spool forever) by bisecting the
        batch: k bad records among n cost about 2k*log2(n) transactions, not the n of writing row by row, which
        let a 2 % rate of bad records stall capture for half a minute."""
        if len(records) == 1:
            self._reject(records[0], exc)
            return True
        middle = len(records) // 2
        for part in (slice(None, middle), slice(middle, None)):
            half, half_lines, half_packed = records[part], lines[part], packed[part]
            try:
                self._store(half, half_lines, half_packed)
            except Exception as err:
                if not is_record_error(err):
                    self._mark_down(err)
                    return False
                if not self._isolate(half, half_lines, half_packed, err):
                    return False
            else:
                self._count(WriterCounters(records_written=len(half)))
        return True

    def _reject(self, record: CallRecord, exc: BaseException) -> None:
        log.error("cannot store call %s (trajectory %s), set aside: %s", record.id, record.trajectory_id, reason(exc))
        directory = self._spool.directory / "rejected"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with open(directory / f"rejected-{os.getpid()}.jsonl", "ab") as out:
                out.write(spool_line(record))
            self._count(WriterCounters(records_rejected=1))
        except (OSError, TypeError) as err:  # TypeError: orjson cannot serialise it
            log.error("could not keep rejected call %s: %s", record.id, err)
            self._count(WriterCounters(records_lost=1))

    def _drop(self, entries: Sequence[_Entry], keep: bool = True) -> None:
        """Let records go from memory: those in the log stay there for replay; those not in it (the log failed) are
        appended now, or, if the disk still fails, held in memory and retried from the writer thread, unless `keep`
        is False (the writer is closing: then they are lost, counted and logged)."""
        spans: dict[Segment, list[tuple[int, int, int]]] = {}
        for entry in entries:
            if entry.segment is not None and entry.line is not None:
                spans.setdefault(entry.segment, []).append((entry.offset, len(entry.line), 1))
        for logged, where in spans.items():
            self._spool.drop(logged, where)
        unlogged = sum(1 for entry in entries if entry.segment is None)
        self._count(WriterCounters(records_spooled=len(entries) - unlogged))
        lines: list[bytes] = []
        kept: list[CallRecord] = []
        for entry in entries:
            if entry.segment is not None:
                continue
            if entry.record is None:  # its line holds it (`_Entry`): read back only to be held if the log fails
                assert entry.line is not None
                lines.append(entry.line)
                kept.append(read_spool_line(entry.line))
                continue
            try:
                lines.append(entry.line if entry.line is not None else spool_line(entry.record, entry.packed))
                kept.append(entry.record)
            except Exception as exc:  # what could not be serialised for the log cannot be kept on disk either
                log.error("cannot spool call %s: %s", entry.record.id, exc)
                self._count(WriterCounters(records_lost=1))
        if not lines:
            return
        try:
            data = b"".join(lines)
            segment, offset = self._spool.append(data, len(lines))
            self._spool.drop(segment, [(offset, len(data), len(lines))])
        except OSError as exc:
            if not keep:
                log.error("spool append failed while closing, %d records lost: %s", len(lines), exc)
                self._count(WriterCounters(records_lost=len(lines), spool_errors=1))
                return
            if not self._held:  # once per episode, not once per record while the disk keeps failing
                log.error("spool append failed, holding records in memory to retry: %s", exc)
            with self._cond:
                # Held records count as submitted again: the caller settles this attempt, the retry settles them.
                self._submitted += len(kept)
                self._held.extend(kept)
                self._next_held_retry = time.monotonic() + self._retry_interval_s
            self._count(WriterCounters(spool_errors=1))
        else:
            self._count(WriterCounters(records_spooled=len(lines)))

    def _mark_down(self, exc: BaseException) -> None:
        self._next_ping = time.monotonic() + self._retry_interval_s
        if self.db_up:
            log.warning("database unavailable, spooling records to %s: %s", self._spool.directory, reason(exc))
            self._set_db_up(False)

    def _set_db_up(self, up: bool) -> None:
        with self._cond:
            self.db_up = up
            self._cond.notify_all()

    def _settle(self, count: int) -> None:
        with self._cond:
            self._settled += count
            self._cond.notify_all()

    def _count(self, counts: WriterCounters) -> None:
        with self._cond:
            self.counters.add(counts)

    def _count_unreadable(self) -> None:
        self._count(WriterCounters(records_unreadable=1))
