"""The spool: the record writer's write-ahead log on disk, the durable half of capture.

An answered call must survive a crash of the gateway whatever the database is doing, so every record is appended
here before its answer completes (gateway.recorder.writer decides when and from which thread); once `Spool.append`
returns, the record is in the kernel's page cache and survives the process being killed. A segment is removed once
every record in it is stored. Records let go from memory (queue full, database away) are stored later by replaying
their lines from the file (`Spool.replay`): just those lines while this process holds the segment, the whole file
once it has let go (a stopped or killed process's segments, or past HELD_SPILLED).

Power loss takes what the page cache held: `Syncer` fsyncs the current segment (and the directory, after segments
are created or removed) every fsync interval, so at most that interval's answered calls are at risk; with an
interval of 0 the spool fsyncs every record before `append` returns.

Layout: append-only JSONL segments `spool-<unix_ns>-<pid>.jsonl` in the spool directory, one record a line
(gateway.recorder.spool_lines). The process that owns a segment holds an exclusive flock on it until every record
in it is stored (or it lets the segment go); a whole-file replay takes the same lock, so several gateway processes
can share one spool directory and none replays a segment another is still using.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from gateway.recorder.spool_lines import read_spool_record
from gateway.recorder.threads import name_os_thread
from gateway.store.arrays import PackedArrays
from gateway.store.call_record import CallRecord

log = logging.getLogger("trajgate.writer")

# At most this many segments with records let go from memory keep their descriptor (and lock) for replay by span; older
# ones are let go and replayed whole, as a dead process's are, so a long outage cannot use up the descriptors.
HELD_SPILLED = 64

# Stores a batch of records (and their spool lines and packed arrays) in the database: True once stored, False if
# it is down.
StoreBatch = Callable[[Sequence[CallRecord], Sequence[bytes | None], Sequence[PackedArrays | None]], bool]

_SEGMENT_PREFIX = "spool-"
_SEGMENT_SUFFIX = ".jsonl"


def _segment_order(path: Path) -> tuple[int, int] | None:
    stem = path.name[len(_SEGMENT_PREFIX) : -len(_SEGMENT_SUFFIX)]
    ns, _, pid = stem.partition("-")
    return (int(ns), int(pid)) if ns.isdigit() and pid.isdigit() else None


@dataclass(eq=False)
class Segment:
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
    committed: int = 0  # of them in the database (or set aside as rejected): written from memory or replayed
    dropped: bool = False  # some of them are only in the file now: they must be replayed before removal
    # Where those are, as (offset, length, records): while this process holds the segment it replays just these
    # spans; once it lets the segment go (shutdown, a crash), the next replayer takes the whole file.
    spilled: list[tuple[int, int, int]] = field(default_factory=list)
    closed: bool = False  # rotated: nothing more is appended
    gone: bool = False  # removed or replayed


class Spool:
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
        self._current: Segment | None = None
        self._last_ns = 0
        self._own: dict[Path, Segment] = {}  # this process's segments still on disk
        self._full: list[tuple[Segment, int | None]] = []  # closed when full, left for `sync` to finish
        self._unsynced = False  # appends since the last file sync
        self._dir_dirty = False  # segments created or removed since the last directory sync
        self.syncs = 0

    def append(self, data: bytes, count: int) -> tuple[Segment, int]:
        """Append whole lines to the current segment (opened on demand, or anew when it is full); returns it and
        the offset the lines start at. Called from the event loop and the writer thread."""
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
            offset = segment.size
            segment.mapped[offset : offset + len(data)] = data
            segment.size += len(data)
            segment.appended += count
            self._unsynced = True
            if self._sync_each:
                self._sync_locked()
            return segment, offset

    def _open_segment(self, capacity: int) -> Segment:
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
        segment = Segment(self.directory / name, handle, mapped, capacity, time.monotonic())
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
    def _closing_locked(segment: Segment | None) -> int | None:
        """Mark a segment closed and unmap it; a duplicate of its descriptor for truncating and fsyncing it outside
        the lock (so `submit` is not held up by the disk) while a commit may already remove the segment."""
        if segment is None:
            return None
        segment.closed = True
        if segment.mapped is not None:
            segment.mapped.close()  # what it holds stays in the page cache, to be fsynced through the descriptor
            segment.mapped = None
        return os.dup(segment.handle.fileno()) if segment.handle is not None else None

    def _close(self, segment: Segment | None, duplicate: int | None) -> None:
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

    def commit(self, segment: Segment, count: int) -> None:
        """`count` of the segment's records are in the database: remove it once all are and nothing was dropped."""
        with self._lock:
            segment.committed += count
            self._settle_locked(segment)

    def drop(self, segment: Segment, spans: Sequence[tuple[int, int, int]]) -> None:
        """Some of the segment's records, at `spans` ((offset, length, records) as `append` placed them), were let
        go from memory: from now on only replaying them from the file stores them. The segment stays locked by this
        process, whose replay reads just those spans: replaying it whole, as after a crash, rewrote every record
        already committed from memory, which under sustained overload was most of the writer's catch-up."""
        with self._lock:
            newly, segment.dropped = not segment.dropped, True
            segment.spilled.extend(spans)
            if newly and segment.closed:
                self._bound_held_locked()

    def _bound_held_locked(self) -> None:
        """Let go of the oldest closed segments with spilled records past HELD_SPILLED: replayed whole from then on."""
        held = [s for s in self._own.values() if s.dropped and s.closed and s.handle is not None]
        for segment in held[: max(0, len(held) - HELD_SPILLED)]:
            segment.spilled = []
            self._release(segment)

    def _settle_locked(self, segment: Segment) -> None:
        """Remove a closed segment once every record in it is stored, from memory or replayed from its spans."""
        if segment.dropped and segment.closed and not segment.gone:
            self._bound_held_locked()
        if not segment.closed or segment.gone or segment.committed < segment.appended:
            return
        if segment.dropped and segment.handle is None:
            return  # let go with records only the file holds: whoever replays it removes it
        with contextlib.suppress(FileNotFoundError):
            segment.path.unlink()
        self._dir_dirty = True
        self._release(segment)
        segment.gone = True
        self._own.pop(segment.path, None)

    @staticmethod
    def _release(segment: Segment) -> None:
        handle, segment.handle = segment.handle, None
        if handle is not None:
            with contextlib.suppress(OSError):
                handle.close()  # releases the flock

    def replay(
        self,
        path: Path,
        batch_size: int,
        write: StoreBatch,
        unreadable: Callable[[], None],
    ) -> int | None:
        """Store a closed segment's records through `write` (True once a batch is stored), `batch_size` at a time,
        then remove the file: how many it held, 0 if another process still holds or already took it, None if
        `write` failed part-way (the segment stays for the next attempt; every write is an upsert, so the batches
        already stored are harmless to store again). `unreadable` is told of each line that is not a whole record.
        A segment this process still holds: only the records it let go from memory (`_replay_spans`)."""
        with self._lock:
            own = self._own.get(path)
            if own is not None and not (own.handle is not None and own.closed and not own.gone):
                own = None  # not one this process holds closed: the whole file, under the lock, like any other's
        if own is not None:
            return self._replay_spans(own, batch_size, write, unreadable)
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
            # A zero byte starts the preallocated tail of a segment whose process died before truncating it.
            lines = itertools.takewhile(lambda line: line[:1] != b"\0", handle)
            count = _store_lines(lines, path.name, batch_size, write, unreadable)
            if count is None:
                return None
            path.unlink()
            self.replayed(path)
            return count

    def _replay_spans(
        self,
        segment: Segment,
        batch_size: int,
        write: StoreBatch,
        unreadable: Callable[[], None],
    ) -> int | None:
        """`replay` for a closed segment this process holds: the spans it let go from memory, read through its own
        descriptor; the file is removed once the records still in memory are committed too. None if `write` failed
        (the spans stay)."""
        with self._lock:
            if segment.handle is None:
                return 0  # let go meanwhile: replayed whole
            spans, segment.spilled = segment.spilled, []
            # A duplicate, read outside the lock: `_bound_held_locked` or `close_all` may close the segment's own.
            descriptor = os.dup(segment.handle.fileno())
        lines: list[bytes] = []
        try:
            for offset, length, _ in spans:
                lines.extend(os.pread(descriptor, length, offset).splitlines(keepends=True))
        except OSError:
            with self._lock:
                segment.spilled[:0] = spans
            raise
        finally:
            os.close(descriptor)
        count = _store_lines(lines, f"the spilled records of {segment.path.name}", batch_size, write, unreadable)
        if count is None:
            with self._lock:  # all of it again next time: storing a record twice is harmless, counting it is not
                segment.spilled[:0] = spans
            return None
        with self._lock:
            if segment.handle is not None:  # else let go meanwhile: whoever replays the file whole removes it
                segment.committed += len(lines)  # an unreadable one too: it can never be stored
                segment.dropped = bool(segment.spilled)
                self._settle_locked(segment)
        return count

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
        """Records of this process's segments that only a replay will store: what the writer's `flush` waits on.
        Segments another process sharing the directory replayed are forgotten here."""
        with self._lock:
            for segment in list(self._own.values()):
                if segment.dropped and segment.closed and not segment.path.exists():
                    segment.gone = True
                    del self._own[segment.path]
            return sum(
                sum(records for _, _, records in segment.spilled) if segment.handle is not None else segment.appended
                for segment in self._own.values()
                if segment.dropped
            )

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


def _store_lines(
    lines: Iterable[bytes],
    source: str,
    batch_size: int,
    write: StoreBatch,
    unreadable: Callable[[], None],
) -> int | None:
    """Store the records `lines` hold through `write`, `batch_size` at a time: how many were stored, None as soon as
    a write fails. A line that is not a whole record (a torn write) is skipped and `unreadable` told of it."""
    count = 0
    batch: list[CallRecord] = []
    kept: list[bytes | None] = []
    packed: list[PackedArrays | None] = []
    for number, line in enumerate(lines, 1):
        try:
            record, arrays = read_spool_record(line)
        except (ValueError, TypeError) as exc:
            log.warning("skipping unreadable line %d of %s (torn write?): %s", number, source, exc)
            unreadable()
            continue
        batch.append(record)
        kept.append(line)
        packed.append(arrays)
        if len(batch) == batch_size:
            if not write(batch, kept, packed):
                return None
            count, batch, kept, packed = count + len(batch), [], [], []
    if batch and not write(batch, kept, packed):
        return None
    return count + len(batch)


class Syncer:
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
