"""The record writer: the only way captured calls reach the database.

An answered call must survive a crash of the gateway whatever the database is doing, and the response path must
never wait on the database. So `submit` first appends the record to the spool, an append-only write-ahead log on
disk (one unbuffered write: once it returns, the record is in the kernel's page cache and survives the process
being killed), then puts it on a bounded in-memory queue; one background thread writes the queue to the database
in batches. A segment of the log is removed once every record in it is committed. Records the queue has no room
for, and batches the database cannot take while it is away, are dropped from memory (so memory stays bounded) and
stored later by replaying the log, as is whatever a killed process left. Every write is an idempotent upsert (see
gateway.store.records), which is what makes replaying a record that was already stored harmless. With
TRAJGATE_WRITER_PROCESS the thread hands each batch's database work to a process of its own (gateway.recorder.writer_process)
and waits without the GIL; everything else stays here.

Power loss takes what the page cache held: a second thread fsyncs the current segment (and the directory, after
segments are created or removed) every fsync interval, so at most that interval's answered calls are at risk;
an interval of 0 fsyncs every record before `submit` returns.

Spool layout: append-only JSONL segments `spool-<unix_ns>-<pid>.jsonl` in the spool directory, one record a line.
The writer that owns a segment holds an exclusive flock on it while it may still append or still commits its records
from memory; replay takes the same lock, so several gateway processes can share one spool directory and none
replays a segment another is still using. Records that can never be written (the database rejects their data) go
to `rejected/` for an operator to inspect.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import mmap
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from sqlalchemy import Engine

from gateway.recorder.spool_lines import is_record_error, read_spool_line, reason, spool_line
from gateway.recorder.threads import name_os_thread
from gateway.recorder.writer_process import WriterProcess
from gateway.store.call_record import CallRecord
from gateway.store.courtesy import giving_way
from gateway.store.records import ping, write_calls

log = logging.getLogger("trajgate.writer")

_SEGMENT_PREFIX = "spool-"
_SEGMENT_SUFFIX = ".jsonl"
_DRAINS_PER_FLUSH = 10  # how often per flush interval the writer looks for more records once a batch has begun


def _segment_order(path: Path) -> tuple[int, int] | None:
    stem = path.name[len(_SEGMENT_PREFIX) : -len(_SEGMENT_SUFFIX)]
    ns, _, pid = stem.partition("-")
    return (int(ns), int(pid)) if ns.isdigit() and pid.isdigit() else None


@dataclass(eq=False)
class _Segment:
    """One segment this process appended to, and how far its records got."""

    path: Path
    # Open, and flock'ed, while this process may append to it or still commits its records from memory: no other
    # process replays it meanwhile. Closed once it is handed to replay (dropped) or removed.
    handle: BinaryIO | None
    mapped: mmap.mmap | None  # the preallocated file, mapped while it is the current segment
    capacity: int
    opened: float
    size: int = 0
    appended: int = 0
    committed: int = 0  # of them in the database (or set aside as rejected), written from memory
    dropped: bool = False  # some of them are only in the file now: the file must be replayed before removal
    closed: bool = False  # rotated: nothing more is appended
    gone: bool = False  # removed or replayed


class _Spool:
    """The write-ahead log: the segment files of one spool directory and the one segment this process appends to.

    Every record is appended before its answer completes. A segment is preallocated (so a full disk is an error at
    creation, not a SIGBUS later) and mapped, and an append is a copy into the mapping: the bytes are then in the
    kernel's page cache, so they survive the process, and no system call is made. That matters: a `write()` releases
    the GIL, and the writer thread, busy building rows, then kept the event loop waiting up to a switch interval
    (5 ms) per record. A segment is closed by rotation, or when full, and truncated to what it holds; it is removed
    once every record in it is committed from memory, or, if some were dropped from memory (queue full, database
    away), once it has been replayed from the file. `sync` makes what was appended durable across power loss; it
    runs every fsync interval on its own thread, or after every append when the interval is 0. `fsync` is a seam for
    tests."""

    def __init__(
        self,
        directory: Path,
        segment_bytes: int = 16 * 1024 * 1024,
        sync_each: bool = False,
        fsync: Callable[[int], None] = os.fsync,
    ) -> None:
        self.directory = directory
        self._segment_bytes = segment_bytes
        self._sync_each = sync_each
        self._fsync = fsync
        self._lock = threading.Lock()
        self._current: _Segment | None = None
        self._last_ns = 0
        self._own: dict[Path, _Segment] = {}  # this process's segments still on disk
        self._full: list[tuple[_Segment, int | None]] = []  # closed when full, left for `sync` to finish
        self._unsynced = False  # appends since the last file sync
        self._dir_dirty = False  # segments created or removed since the last directory sync
        self.syncs = 0

    def append(self, data: bytes, count: int) -> _Segment:
        """Append whole lines to the current segment (opened on demand, or anew when it is full); returns it.
        Called from the event loop and the writer thread."""
        with self._lock:
            segment = self._current
            if segment is not None and segment.size + len(data) > segment.capacity:
                self._current = None
                # Truncating and fsyncing it are for the sync thread (or the writer's), never for this path.
                self._full.append((segment, self._closing_locked(segment)))
                segment = None
            if segment is None:
                segment = self._current = self._open_segment(max(self._segment_bytes, len(data)))
            assert segment.mapped is not None
            segment.mapped[segment.size : segment.size + len(data)] = data
            segment.size += len(data)
            segment.appended += count
            self._unsynced = True
            if self._sync_each:
                self._sync_locked()
            return segment

    def _open_segment(self, capacity: int) -> _Segment:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._last_ns = max(time.time_ns(), self._last_ns + 1)
        name = f"{_SEGMENT_PREFIX}{self._last_ns}-{os.getpid()}{_SEGMENT_SUFFIX}"
        temporary = self.directory / f".{name}.tmp"
        # Held open until the segment is removed or handed to replay, so no context manager.
        handle = open(temporary, "x+b", buffering=0)  # noqa: SIM115
        try:
            os.posix_fallocate(handle.fileno(), 0, capacity)
            mapped = mmap.mmap(handle.fileno(), capacity)
            # Lock before the segment becomes visible under its real name, so no replayer takes it while we append.
            fcntl.flock(handle, fcntl.LOCK_EX)
            os.replace(temporary, self.directory / name)
        except (OSError, ValueError):
            handle.close()
            with contextlib.suppress(OSError):
                temporary.unlink()
            raise
        self._dir_dirty = True
        segment = _Segment(self.directory / name, handle, mapped, capacity, time.monotonic())
        self._own[segment.path] = segment
        return segment

    def rotate(self) -> None:
        """Close the current segment so it can be removed once committed or replayed."""
        self.finish_full()
        with self._lock:
            segment, self._current = self._current, None
            closing = self._closing_locked(segment)
        self._close(segment, closing)

    def finish_full(self) -> None:
        """Truncate, fsync and settle the segments `append` closed because they were full."""
        with self._lock:
            full, self._full = self._full, []
        for segment, closing in full:
            self._close(segment, closing)

    def rotate_if_due(self, max_age_s: float) -> None:
        """Rotate a non-empty current segment older than `max_age_s`, so a healthy database keeps the log short: a
        closed segment whose records are all committed is removed."""
        self.finish_full()
        with self._lock:
            segment = self._current
            if segment is None or segment.appended == 0 or time.monotonic() - segment.opened < max_age_s:
                return
            self._current = None
            closing = self._closing_locked(segment)
        self._close(segment, closing)

    @staticmethod
    def _closing_locked(segment: _Segment | None) -> int | None:
        """Mark a segment closed and unmap it; a duplicate of its descriptor for truncating and fsyncing it outside
        the lock (so `submit` is not held up by the disk) while a commit may already remove the segment."""
        if segment is None:
            return None
        segment.closed = True
        if segment.mapped is not None:
            segment.mapped.close()  # what it holds stays in the page cache, to be fsynced through the descriptor
            segment.mapped = None
        return os.dup(segment.handle.fileno()) if segment.handle is not None else None

    def _close(self, segment: _Segment | None, duplicate: int | None) -> None:
        if segment is None:
            return
        if duplicate is not None:
            try:
                os.ftruncate(duplicate, segment.size)  # the unused preallocated tail
                self._fsync(duplicate)
            except OSError as exc:
                log.error("closing spool segment %s failed: %s", segment.path.name, exc)
            finally:
                os.close(duplicate)
        with self._lock:
            self._settle_locked(segment)

    def commit(self, segment: _Segment, count: int) -> None:
        """`count` of the segment's records are in the database: remove it once all are and nothing was dropped."""
        with self._lock:
            segment.committed += count
            self._settle_locked(segment)

    def drop(self, segment: _Segment) -> None:
        """Some of the segment's records were let go from memory: from now on only replaying the file stores them."""
        with self._lock:
            segment.dropped = True
            self._settle_locked(segment)

    def _settle_locked(self, segment: _Segment) -> None:
        if not segment.closed or segment.gone:
            return
        if segment.dropped:
            self._release(segment)  # unlocked: this process's replay, or another's, may take it now
        elif segment.committed >= segment.appended:
            with contextlib.suppress(FileNotFoundError):
                segment.path.unlink()
            self._dir_dirty = True
            self._release(segment)
            segment.gone = True
            self._own.pop(segment.path, None)

    @staticmethod
    def _release(segment: _Segment) -> None:
        handle, segment.handle = segment.handle, None
        if handle is not None:
            with contextlib.suppress(OSError):
                handle.close()  # releases the flock

    def replayed(self, path: Path) -> None:
        """A segment was replayed and removed (by this process)."""
        with self._lock:
            self._dir_dirty = True
            segment = self._own.pop(path, None)
            if segment is not None:
                segment.gone = True

    def sync(self) -> None:
        """One group fsync: the current segment if anything was appended since the last, the directory if segments
        were created or removed. The file is synced through a duplicate descriptor, outside the lock, so appends go
        on while the disk works and a concurrent rotation cannot close the descriptor under it."""
        self.finish_full()
        with self._lock:
            segment = self._current
            duplicate = None
            if self._unsynced and segment is not None and segment.handle is not None:
                duplicate = os.dup(segment.handle.fileno())
            self._unsynced = False
            directory, self._dir_dirty = self._dir_dirty, False
        try:
            if duplicate is not None:
                self._fsync(duplicate)
            if directory:
                self._sync_directory()
            self.syncs += 1
        except OSError:
            with self._lock:  # try again next time
                self._unsynced = self._unsynced or duplicate is not None
                self._dir_dirty = self._dir_dirty or directory
            raise
        finally:
            if duplicate is not None:
                os.close(duplicate)

    def _sync_locked(self) -> None:
        assert self._current is not None and self._current.handle is not None
        self._fsync(self._current.handle.fileno())
        self._unsynced = False
        if self._dir_dirty:
            self._sync_directory()
            self._dir_dirty = False
        self.syncs += 1

    def _sync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            self._fsync(fd)
        finally:
            os.close(fd)

    def close_all(self) -> None:
        """Close every descriptor this process still holds and sync the directory (at shutdown, after the last
        rotation, so the segments left for the next start are durable)."""
        with self._lock:
            for segment in self._own.values():
                if segment.closed:  # a submit after close may have opened a new current segment
                    self._release(segment)
        try:
            self.sync()
        except OSError as exc:
            log.error("fsync of the spool directory failed at shutdown: %s", exc)

    def segments(self) -> list[Path]:
        """Segment files, oldest first (this process's and any other's)."""
        try:
            entries = [Path(entry.path) for entry in os.scandir(self.directory)]
        except FileNotFoundError:
            return []
        found = [
            (order, path)
            for path in entries
            if path.name.startswith(_SEGMENT_PREFIX)
            and path.name.endswith(_SEGMENT_SUFFIX)
            and (order := _segment_order(path)) is not None
        ]
        return [path for _, path in sorted(found)]

    @property
    def current_dropped(self) -> bool:
        segment = self._current
        return segment is not None and segment.dropped

    @property
    def pending(self) -> int:
        """Records of this process's segments that only a replay will store: what `RecordWriter.flush` waits on.
        Segments another process sharing the directory replayed are forgotten here."""
        with self._lock:
            for segment in list(self._own.values()):
                if segment.dropped and segment.closed and not segment.path.exists():
                    segment.gone = True
                    del self._own[segment.path]
            return sum(segment.appended for segment in self._own.values() if segment.dropped)

    def size_bytes(self) -> int:
        """Bytes the segments hold (for this process's current one, what was appended, not what was preallocated)."""
        with self._lock:
            current = self._current
            used = {current.path: current.size} if current is not None else {}
        total = 0
        for path in self.segments():
            with contextlib.suppress(FileNotFoundError):  # replayed since the listing
                total += used[path] if path in used else path.stat().st_size
        return total


# At most this many calls in flight, the writer gives way to the event loop (RecordWriter._gives_way).
FEW_CALLS_IN_FLIGHT = 4

# A record, the log segment holding it (None: not logged) and its spool line (None: it could not be made).
_Entry = tuple[CallRecord, "_Segment | None", bytes | None]


class _Syncer:
    """Calls `tick` (a group fsync) every `interval_s` until stopped, then once more. `wait` is a seam for tests."""

    def __init__(
        self, tick: Callable[[], None], interval_s: float, wait: Callable[[float], bool] | None = None
    ) -> None:
        self.interval_s = interval_s
        self._tick = tick
        self._stop = threading.Event()
        self._wait = wait or self._stop.wait
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="trajgate-wal-sync", daemon=True)
        self._thread.start()

    def run(self) -> None:
        name_os_thread()
        while not self._wait(self.interval_s):
            self._tick()
        self._tick()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


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
    ) -> None:
        self._engine = engine
        # How the writer thread shares the event loop's core: it pauses for `pause_s` after each `slice_s` of
        # writing a batch from the queue while it keeps up (gateway.store.courtesy); 0 never pauses.
        self._slice_s = slice_s
        self._pause_s = pause_s
        self._calls_in_flight = calls_in_flight
        self._process = process  # where batches are written; None: on the writer thread itself
        self._spool = _Spool(Path(spool_dir), segment_bytes, sync_each=fsync_interval_s == 0, fsync=fsync)
        self._syncer = _Syncer(self._sync, fsync_interval_s) if fsync_interval_s > 0 else None
        self._queue: queue.Queue[_Entry] = queue.Queue(maxsize=queue_size)
        self._batch_size = batch_size
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
        self.records_logged = 0
        self.records_unlogged = 0  # answered without a copy on disk (the log failed): a crash would lose them
        self.records_written = 0
        self.records_spooled = 0  # dropped from memory, so stored by replaying the log
        self.records_rejected = 0
        self.records_lost = 0
        self.records_replayed = 0
        self.records_unreadable = 0  # spool lines replay could not read (a torn append): lost, usually at start-up
        self.spool_errors = 0
        self.sync_errors = 0
        self.write_errors = 0

    # --- the hot path -------------------------------------------------------------------------------------------

    def submit(self, record: CallRecord) -> None:
        """Append the record to the log (so it survives a crash once this returns), then hand it to the writer
        thread without waiting: the queue if it has room; if not, the logged copy is all there is until replay."""
        segment, line = self._log(record)
        with self._cond:
            self._submitted += 1
            self.records_logged += int(segment is not None)
            closed = self._closed
            if not closed:
                try:
                    self._queue.put_nowait((record, segment, line))
                    return
                except queue.Full:
                    pass
        if not self._spilling:
            self._spilling = True
            if closed:
                log.warning("record submitted after the writer closed; it waits in the spool for the next start")
            else:
                log.warning("writer queue full (%d records); the spool keeps the rest", self._queue.maxsize)
        self._drop([(record, segment, line)])
        self._settle(1)

    def _log(self, record: CallRecord) -> tuple[_Segment | None, bytes | None]:
        """Append one record to the log: its segment, None (never an exception) if it could not be, and its line."""
        try:
            line = spool_line(record)
        except Exception as exc:  # whatever the record holds, submit must not raise
            log.error("cannot log call %s: %s", record.id, exc)
            self._count(records_unlogged=1)
            return None, None
        try:
            segment = self._spool.append(line, 1)
        except Exception as exc:  # OSError (EMFILE, a full disk) or anything else: the call is answered regardless
            if not self._log_failing:  # once per episode, not once per record while the disk keeps failing
                self._log_failing = True
                log.error("spool append failed; records are kept in memory only until it works again: %s", exc)
            self._count(records_unlogged=1, spool_errors=1)
            return None, line
        self._log_failing = False
        return segment, line

    # --- lifecycle ----------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the writer thread, which first replays what a previous process left in the spool, and the
        group-fsync thread."""
        if self._thread is None:
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
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
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
            self._drop([(record, None, None) for record in held], keep=False)
            self._settle(len(held))
        self._spool.rotate()
        if self._syncer is not None:
            self._syncer.stop()
        self._spool.close_all()
        if self._process is not None:
            self._process.close()

    # --- counters -----------------------------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    @property
    def spool_bytes(self) -> int:
        return self._spool.size_bytes()

    @property
    def records_held(self) -> int:
        return len(self._held)

    @property
    def syncs(self) -> int:
        return self._spool.syncs

    # --- the group-fsync thread ---------------------------------------------------------------------------------

    def _sync(self) -> None:
        try:
            self._spool.sync()
        except OSError as exc:
            self._count(sync_errors=1)
            log.error("fsync of the spool failed (appended records are safe from a crash, not power loss): %s", exc)

    # --- the writer thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        name_os_thread()
        if self._process is not None:
            try:
                self._process.start()
            except OSError as exc:  # tried again with the first batch; until then records wait in the queue and log
                log.error("cannot start the writer process: %s", exc)
        self._replay_spool()
        while True:
            try:
                batch = self._next_batch()
                if batch:
                    self._inflight = batch
                    with giving_way(self._slice_s if self._gives_way() else 0.0, self._pause_s):
                        written = self.db_up and self._write(
                            [record for record, _, _ in batch], [line for _, _, line in batch]
                        )
                    if written:
                        self._committed(batch)
                    else:
                        self._drop(batch)
                    self._inflight = ()
                    self._settle(len(batch))
                elif self._stopping.is_set():
                    break
                self._spool.rotate_if_due(self._segment_age_s)
                self._recover_or_replay()
            except Exception:
                # Never let the thread die: everything after it would sit in the queue and then spill.
                log.exception("unexpected error in the writer thread")
                time.sleep(self._retry_interval_s)
        if self.db_up:
            self._replay_spool()
        self._spool.rotate()

    def _gives_way(self) -> bool:
        """Whether this batch is written in slices with pauses for the event loop (gateway.store.courtesy). Only when few
        calls are in flight, where a stretch of the writer's work is a call's delay: with many, each call mostly
        waits its turn anyway, and the pauses' cost (a sleep, the GIL handed back and forth) would come out of the
        gateway's throughput. And only while the writer keeps up: with a batch's worth queued behind this one,
        pausing would let a saturated loop starve it, since a thread that gave the GIL up gets it back from a busy
        loop only at the interpreter's forced switch (every 5 ms)."""
        return (
            self._slice_s > 0
            and self._queue.qsize() < self._batch_size
            and self._calls_in_flight() <= FEW_CALLS_IN_FLIGHT
        )

    def _next_batch(self) -> list[_Entry]:
        if self._held and not self._stopping.is_set() and time.monotonic() >= self._next_held_retry:
            return [(record, None, None) for record in self._take_held(self._batch_size)]
        try:
            batch = [self._queue.get(timeout=self._flush_interval_s)]
        except queue.Empty:
            return []
        # The rest of the batch is gathered by draining the queue a few times per flush interval, not by waking up
        # for each record: every wake-up takes the GIL from the event loop for a moment (two context switches when
        # both share a core), and under load that happened once per answered call.
        deadline = time.monotonic() + self._flush_interval_s
        while True:
            while len(batch) < self._batch_size:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            remaining = deadline - time.monotonic()
            if len(batch) >= self._batch_size or remaining <= 0 or self._stopping.is_set():
                return batch
            self._stopping.wait(min(remaining, self._flush_interval_s / _DRAINS_PER_FLUSH))

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
                return entries

    def _committed(self, entries: Sequence[_Entry]) -> None:
        """Count stored records against their segments, so fully committed segments can be removed."""
        per_segment: dict[_Segment, int] = {}
        for _, segment, _ in entries:
            if segment is not None:
                per_segment[segment] = per_segment.get(segment, 0) + 1
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
                count = self._replay_segment(path)
                if count is None:
                    return False
                replayed += count
            return True
        finally:
            with self._cond:
                self._cond.notify_all()
            if replayed:
                log.info("replayed %d spooled records into the database", replayed)

    def _replay_segment(self, path: Path) -> int | None:
        try:
            handle = open(path, "rb")  # noqa: SIM115 - the `with handle:` below, once it is known to exist
        except FileNotFoundError:
            return 0  # another process replayed it after we listed the directory
        with handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return 0  # a live writer still appends to it or commits it from memory, or another replays it
            if os.fstat(handle.fileno()).st_nlink == 0:
                return 0  # replayed and removed between our open and our lock
            count = 0
            batch: list[CallRecord] = []
            lines: list[bytes | None] = []
            for number, line in enumerate(handle, 1):
                if line[:1] == b"\0":
                    break  # the preallocated tail of a segment whose process died before truncating it
                try:
                    batch.append(read_spool_line(line))
                    lines.append(line)
                except (ValueError, TypeError) as exc:
                    log.warning("skipping unreadable line %d of %s (torn write?): %s", number, path.name, exc)
                    self._count(records_unreadable=1)
                    continue
                if len(batch) == self._batch_size:
                    if not self._write(batch, lines):
                        return None
                    count, batch, lines = count + len(batch), [], []
            if batch and not self._write(batch, lines):
                return None
            path.unlink()
            self._spool.replayed(path)
            self._count(records_replayed=count + len(batch))
            return count + len(batch)

    def _write(self, records: Sequence[CallRecord], lines: Sequence[bytes | None]) -> bool:
        """Upsert one batch (`lines`: the records' spool lines, where known); True once every record is in the
        database (or rejected), False if it is down."""
        try:
            self._store(records, lines)
        except Exception as exc:
            self._count(write_errors=1)
            if not is_record_error(exc):
                self._mark_down(exc)
                return False
            return self._isolate(records, lines, exc)
        self._count(records_written=len(records))
        return True

    def _store(self, records: Sequence[CallRecord], lines: Sequence[bytes | None]) -> None:
        if self._process is None:
            write_calls(self._engine, records)
            return
        # Lines the hot path made are sent as they are; a record held in memory or replayed without one gets its own.
        self._process.write([spool_line(record) if line is None else line for record, line in zip(records, lines)])

    def _isolate(self, records: Sequence[CallRecord], lines: Sequence[bytes | None], exc: BaseException) -> bool:
        """Set aside the records the database refuses (so one cannot block the spool forever) by bisecting the
        batch: k bad records among n cost about 2k*log2(n) transactions, not the n of writing row by row, which
        let a 2 % rate of bad records stall capture for half a minute."""
        if len(records) == 1:
            self._reject(records[0], exc)
            return True
        middle = len(records) // 2
        for half, half_lines in ((records[:middle], lines[:middle]), (records[middle:], lines[middle:])):
            try:
                self._store(half, half_lines)
            except Exception as err:
                if not is_record_error(err):
                    self._mark_down(err)
                    return False
                if not self._isolate(half, half_lines, err):
                    return False
            else:
                self._count(records_written=len(half))
        return True

    def _reject(self, record: CallRecord, exc: BaseException) -> None:
        log.error("cannot store call %s (trajectory %s), set aside: %s", record.id, record.trajectory_id, reason(exc))
        directory = self._spool.directory / "rejected"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with open(directory / f"rejected-{os.getpid()}.jsonl", "ab") as out:
                out.write(spool_line(record))
            self._count(records_rejected=1)
        except (OSError, TypeError) as err:  # TypeError: orjson cannot serialise it
            log.error("could not keep rejected call %s: %s", record.id, err)
            self._count(records_lost=1)

    def _drop(self, entries: Sequence[_Entry], keep: bool = True) -> None:
        """Let records go from memory: those in the log stay there for replay; those not in it (the log failed) are
        appended now, or, if the disk still fails, held in memory and retried from the writer thread, unless `keep`
        is False (the writer is closing: then they are lost, counted and logged)."""
        for logged in {segment for _, segment, _ in entries if segment is not None}:
            self._spool.drop(logged)
        self._count(records_spooled=len(entries) - sum(1 for _, segment, _ in entries if segment is None))
        lines: list[bytes] = []
        kept: list[CallRecord] = []
        for record, segment, _ in entries:
            if segment is not None:
                continue
            try:
                lines.append(spool_line(record))
                kept.append(record)
            except Exception as exc:  # what could not be serialised for the log cannot be kept on disk either
                log.error("cannot spool call %s: %s", record.id, exc)
                self._count(records_lost=1)
        if not lines:
            return
        try:
            self._spool.drop(self._spool.append(b"".join(lines), len(lines)))
        except OSError as exc:
            if not keep:
                log.error("spool append failed while closing, %d records lost: %s", len(lines), exc)
                self._count(records_lost=len(lines), spool_errors=1)
                return
            if not self._held:  # once per episode, not once per record while the disk keeps failing
                log.error("spool append failed, holding records in memory to retry: %s", exc)
            with self._cond:
                # Held records count as submitted again: the caller settles this attempt, the retry settles them.
                self._submitted += len(kept)
                self._held.extend(kept)
                self._next_held_retry = time.monotonic() + self._retry_interval_s
            self._count(spool_errors=1)
        else:
            self._count(records_spooled=len(lines))

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

    def _count(
        self,
        records_unlogged: int = 0,
        records_written: int = 0,
        records_spooled: int = 0,
        records_rejected: int = 0,
        records_lost: int = 0,
        records_replayed: int = 0,
        records_unreadable: int = 0,
        spool_errors: int = 0,
        sync_errors: int = 0,
        write_errors: int = 0,
    ) -> None:
        # The event loop thread and the writer thread both count; `+=` on an attribute is not atomic.
        with self._cond:
            self.records_unlogged += records_unlogged
            self.records_written += records_written
            self.records_spooled += records_spooled
            self.records_rejected += records_rejected
            self.records_lost += records_lost
            self.records_replayed += records_replayed
            self.records_unreadable += records_unreadable
            self.spool_errors += spool_errors
            self.sync_errors += sync_errors
            self.write_errors += write_errors
