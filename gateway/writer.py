"""The record writer: the only way captured calls reach the database.

The response path must never wait on the database and no record may be lost, so `submit` only puts the record on
a bounded in-memory queue (or, when that is full, appends it to a disk spool) and one background thread does all
database work in batches. When the database is unreachable the thread spools batches instead, polls the database,
and replays the spool when it is back. Every write is an idempotent upsert (see gateway.store.records), which is
what makes replaying a segment again after a crash between commit and delete harmless.

Spool layout: append-only JSONL segments `spool-<unix_ns>-<pid>.jsonl` in the spool directory, one record a line.
The writer that owns a segment holds an exclusive flock on it while it may still append; replay takes the same lock,
so several gateway processes can share one spool directory and none replays a segment another is still writing.
Records that can never be written (the database rejects their data) go to `rejected/` for an operator to inspect.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any, BinaryIO

import orjson
from sqlalchemy import Engine
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, SQLAlchemyError, StatementError

from gateway.records import CallRecord
from gateway.store.arrays import decode_ids, decode_logprobs, encode_ids, encode_logprobs
from gateway.store.records import ping, write_calls

log = logging.getLogger("trajgate.writer")

_FIELDS = tuple(f.name for f in fields(CallRecord))
_SEGMENT_PREFIX = "spool-"
_SEGMENT_SUFFIX = ".jsonl"


# Token arrays travel as base64 of the store's packed bytes: JSON (orjson) turns a -inf logprob into null, and
# parsing thousands of JSON numbers per record made replay the bottleneck of catching up after an outage.
_PACKED: dict[str, tuple[Callable[[Any], bytes | None], Callable[[bytes], list[Any] | None]]] = {
    "prompt_token_ids": (encode_ids, decode_ids),
    "completion_token_ids": (encode_ids, decode_ids),
    "completion_logprobs": (encode_logprobs, decode_logprobs),
}


def spool_line(record: CallRecord) -> bytes:
    """One JSONL line, lossless for every field the database stores."""
    data = {name: getattr(record, name) for name in _FIELDS}
    for name, (encode, _) in _PACKED.items():
        try:
            packed = encode(data[name])
        except (TypeError, OverflowError):
            continue  # unpackable values stay JSON, to be refused by the store and kept in rejected/
        if packed is not None:
            data[name] = base64.b64encode(packed).decode()
    return orjson.dumps(data, option=orjson.OPT_APPEND_NEWLINE | orjson.OPT_NON_STR_KEYS)


def read_spool_line(line: bytes) -> CallRecord:
    """Inverse of `spool_line`; raises ValueError for a line that is not a whole record (a torn append)."""
    data = orjson.loads(line)  # a torn line is truncated JSON, so it fails here
    if not isinstance(data, dict):
        raise ValueError("not a record")
    for name, (_, decode) in _PACKED.items():
        if isinstance(data.get(name), str):
            data[name] = decode(base64.b64decode(data[name]))
    # Fields added to CallRecord after a line was spooled read as None, so an upgrade can replay an older spool.
    values: dict[str, Any] = {name: data.get(name) for name in _FIELDS}
    return CallRecord(**values)


def _segment_order(path: Path) -> tuple[int, int] | None:
    stem = path.name[len(_SEGMENT_PREFIX) : -len(_SEGMENT_SUFFIX)]
    ns, _, pid = stem.partition("-")
    return (int(ns), int(pid)) if ns.isdigit() and pid.isdigit() else None


class _Spool:
    """The segment files of one spool directory, and the one segment this process appends to."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._file: BinaryIO | None = None
        self._path: Path | None = None
        self._last_ns = 0
        # Records this process appended, per segment not yet replayed: what `RecordWriter.flush` waits on.
        self._own: dict[Path, int] = {}
        # Their sum, readable without the lock (which may be held across a disk write).
        self.pending = 0

    def append(self, lines: bytes, count: int) -> None:
        """Append whole lines; called from the event loop and the writer thread, so it only writes and flushes."""
        with self._lock:
            if self._file is None:
                self._open_segment()
            assert self._file is not None and self._path is not None
            try:
                self._file.write(lines)
                self._file.flush()
            except OSError:
                # The segment may now end in a partial line: start a new one so only this append is torn.
                handle, self._file, self._path = self._file, None, None
                with contextlib.suppress(OSError):
                    handle.close()
                raise
            self._own[self._path] = self._own.get(self._path, 0) + count
            self.pending += count

    def _open_segment(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._last_ns = max(time.time_ns(), self._last_ns + 1)
        name = f"{_SEGMENT_PREFIX}{self._last_ns}-{os.getpid()}{_SEGMENT_SUFFIX}"
        temporary = self.directory / f".{name}.tmp"
        handle = open(temporary, "xb")  # held open across appends until rotate()
        try:
            # Lock before the segment becomes visible under its real name, so no replayer takes it while we append.
            fcntl.flock(handle, fcntl.LOCK_EX)
            os.replace(temporary, self.directory / name)
        except OSError:
            handle.close()
            with contextlib.suppress(OSError):
                temporary.unlink()
            raise
        self._file, self._path = handle, self.directory / name

    def rotate(self) -> None:
        """Close the current segment so it can be replayed; the fsync happens outside the lock so `submit`,
        which may be waiting for the lock, is not held up by the disk."""
        with self._lock:
            handle, self._file, self._path = self._file, None, None
        if handle is not None:
            os.fsync(handle.fileno())
            handle.close()  # releases the flock

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

    def forget_replayed(self) -> None:
        """Drop counts for own segments that are gone (replayed here or by another process sharing the dir)."""
        with self._lock:
            self._own = {path: n for path, n in self._own.items() if path == self._path or path.exists()}
            self.pending = sum(self._own.values())

    def size_bytes(self) -> int:
        total = 0
        for path in self.segments():
            with contextlib.suppress(FileNotFoundError):  # replayed since the listing
                total += path.stat().st_size
        return total


def _reason(exc: BaseException) -> str:
    """The driver's first line only: SQLAlchemy's message carries the SQL and its parameters (whole records)."""
    text = str(getattr(exc, "orig", None) or exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _is_record_error(exc: BaseException) -> bool:
    """Whether the failure is about the data of some record (retrying it can never succeed) rather than the
    database being unavailable (retrying later will). Unknown database errors count as unavailability, so a
    misconfigured or read-only database spools records instead of rejecting them."""
    if isinstance(exc, (IntegrityError, DataError)):
        return True
    if isinstance(exc, DBAPIError):
        return False
    if isinstance(exc, StatementError):
        return True  # raised while binding parameters, e.g. JSON that cannot be serialized
    return not isinstance(exc, SQLAlchemyError)  # e.g. a token id that does not fit int32


class RecordWriter:
    """Batches records from the hot path into the database on one background thread, spooling to disk when the
    database is down or the queue is full, so that no record is lost and `submit` never blocks."""

    def __init__(
        self,
        engine: Engine,
        spool_dir: Path,
        queue_size: int = 10_000,
        batch_size: int = 256,
        flush_interval_s: float = 0.05,
        retry_interval_s: float = 1.0,
    ) -> None:
        self._engine = engine
        self._spool = _Spool(Path(spool_dir))
        self._queue: queue.Queue[CallRecord] = queue.Queue(maxsize=queue_size)
        self._batch_size = batch_size
        self._flush_interval_s = flush_interval_s
        self._retry_interval_s = retry_interval_s
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        # Guards the counters below and `_closed`; flush() waits on it for progress.
        self._cond = threading.Condition()
        self._closed = False
        self._submitted = 0
        self._settled = 0  # taken off the hot path: written, spooled, rejected or lost
        self._inflight: Sequence[CallRecord] = ()
        # Records the spool could not take (EMFILE, a full disk): kept in memory and retried by the writer thread,
        # because a failing disk says nothing about the records themselves.
        self._held: deque[CallRecord] = deque()
        self._next_held_retry = 0.0
        self._next_ping = 0.0
        self._next_spill_replay = 0.0
        self._spilling = False
        self.db_up = True
        self.records_written = 0
        self.records_spooled = 0
        self.records_rejected = 0
        self.records_lost = 0
        self.records_replayed = 0
        self.records_unreadable = 0  # spool lines replay could not read (a torn append): lost, usually at start-up
        self.spool_errors = 0
        self.write_errors = 0

    # --- the hot path -------------------------------------------------------------------------------------------

    def submit(self, record: CallRecord) -> None:
        """Hand a record over without waiting: the queue if it has room, else the spool (a buffered append)."""
        with self._cond:
            self._submitted += 1
            closed = self._closed
            if not closed:
                try:
                    self._queue.put_nowait(record)
                    return
                except queue.Full:
                    pass
        if not self._spilling:
            self._spilling = True
            if closed:
                log.warning("record submitted after the writer closed; spooling it for the next start")
            else:
                log.warning("writer queue full (%d records); spilling to the spool", self._queue.maxsize)
        self._to_spool([record])
        self._settle(1)

    # --- lifecycle ----------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the writer thread; it first replays what a previous process left in the spool."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="trajgate-writer", daemon=True)
            self._thread.start()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every record submitted so far is in the database, or safely spooled while the database is
        down. False on timeout (for instance under sustained overload, when the spool never empties)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            target = self._submitted
            while self._settled < target or self._held or (self.db_up and self._spool.pending):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop accepting (later submits go to the spool), drain the queue, replay the spool once more if the
        database is up, and close the spool segment. Whatever the thread cannot finish in time is spooled.
        Calling it again only closes the segment that submits after the first close appended to."""
        with self._cond:
            already_closed, self._closed = self._closed, True
        if already_closed:
            self._spool.rotate()
            return
        self._stopping.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        if thread is None or thread.is_alive():
            if thread is not None:
                log.error("writer still busy %.0f s after close; spooling what it holds", timeout_s)
            # Duplicates of the in-flight batch are harmless: every write is an upsert.
            leftovers = list(self._inflight) + self._take_all()
            if leftovers:
                self._to_spool(leftovers)
                self._settle(len(leftovers))
        held = self._take_held(len(self._held))
        if held:  # the last chance to keep them: a spool that fails now loses them
            self._to_spool(held, keep=False)
            self._settle(len(held))
        self._spool.rotate()

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

    # --- the writer thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        self._replay_spool()
        while True:
            try:
                batch = self._next_batch()
                if batch:
                    self._inflight = batch
                    if not (self.db_up and self._write(batch)):
                        self._to_spool(batch)
                    self._inflight = ()
                    self._settle(len(batch))
                elif self._stopping.is_set():
                    break
                self._recover_or_replay()
            except Exception:
                # Never let the thread die: everything after it would sit in the queue and then spill.
                log.exception("unexpected error in the writer thread")
                time.sleep(self._retry_interval_s)
        if self.db_up:
            self._replay_spool()
        self._spool.rotate()

    def _next_batch(self) -> list[CallRecord]:
        if self._held and not self._stopping.is_set() and time.monotonic() >= self._next_held_retry:
            return self._take_held(self._batch_size)
        try:
            batch = [self._queue.get(timeout=self._flush_interval_s)]
        except queue.Empty:
            return []
        deadline = time.monotonic() + self._flush_interval_s
        while len(batch) < self._batch_size:
            try:
                batch.append(self._queue.get_nowait())
                continue
            except queue.Empty:
                pass
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._stopping.is_set():
                break
            try:
                batch.append(self._queue.get(timeout=remaining))
            except queue.Empty:
                break
        return batch

    def _take_held(self, limit: int) -> list[CallRecord]:
        records = []
        while self._held and len(records) < limit:
            records.append(self._held.popleft())
        return records

    def _take_all(self) -> list[CallRecord]:
        records = []
        while True:
            try:
                records.append(self._queue.get_nowait())
            except queue.Empty:
                return records

    def _recover_or_replay(self) -> None:
        """While down, poll the database every retry interval and replay the spool once it answers; while up,
        replay records that spilled because the queue was full, when the queue has gone quiet (or every retry
        interval under sustained load, so the spill cannot grow forever)."""
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
        """Write every closed segment, oldest first, deleting each once committed. False if the database failed
        part-way; the remaining segments stay for the next attempt."""
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
            self._spool.forget_replayed()
            with self._cond:
                self._cond.notify_all()
            if replayed:
                log.info("replayed %d spooled records into the database", replayed)

    def _replay_segment(self, path: Path) -> int | None:
        try:
            handle = open(path, "rb")
        except FileNotFoundError:
            return 0  # another process replayed it after we listed the directory
        with handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return 0  # a live writer still appends to it, or another process is replaying it
            if os.fstat(handle.fileno()).st_nlink == 0:
                return 0  # replayed and removed between our open and our lock
            count = 0
            batch: list[CallRecord] = []
            for number, line in enumerate(handle, 1):
                try:
                    batch.append(read_spool_line(line))
                except (ValueError, TypeError) as exc:
                    log.warning("skipping unreadable line %d of %s (torn write?): %s", number, path.name, exc)
                    self._count(records_unreadable=1)
                    continue
                if len(batch) == self._batch_size:
                    if not self._write(batch):
                        return None
                    count, batch = count + len(batch), []
            if batch and not self._write(batch):
                return None
            path.unlink()
            self._count(records_replayed=count + len(batch))
            return count + len(batch)

    def _write(self, records: Sequence[CallRecord]) -> bool:
        """Upsert one batch; True once every record is in the database (or rejected), False if it is down."""
        try:
            write_calls(self._engine, records)
        except Exception as exc:
            self._count(write_errors=1)
            if not _is_record_error(exc):
                self._mark_down(exc)
                return False
            return self._isolate(records, exc)
        self._count(records_written=len(records))
        return True

    def _isolate(self, records: Sequence[CallRecord], exc: BaseException) -> bool:
        """Set aside the records the database refuses (so one cannot block the spool forever) by bisecting the
        batch: k bad records among n cost about 2k*log2(n) transactions, not the n of writing row by row, which
        let a 2 % rate of bad records stall capture for half a minute."""
        if len(records) == 1:
            self._reject(records[0], exc)
            return True
        middle = len(records) // 2
        for half in (records[:middle], records[middle:]):
            try:
                write_calls(self._engine, half)
            except Exception as err:
                if not _is_record_error(err):
                    self._mark_down(err)
                    return False
                if not self._isolate(half, err):
                    return False
            else:
                self._count(records_written=len(half))
        return True

    def _reject(self, record: CallRecord, exc: BaseException) -> None:
        log.error("cannot store call %s (trajectory %s), set aside: %s", record.id, record.trajectory_id, _reason(exc))
        directory = self._spool.directory / "rejected"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with open(directory / f"rejected-{os.getpid()}.jsonl", "ab") as out:
                out.write(spool_line(record))
            self._count(records_rejected=1)
        except (OSError, TypeError) as err:  # TypeError: orjson cannot serialise it
            log.error("could not keep rejected call %s: %s", record.id, err)
            self._count(records_lost=1)

    def _to_spool(self, records: Sequence[CallRecord], keep: bool = True) -> None:
        """Append records to the spool, never raising into the hot path. A record that cannot be serialised is
        lost (counted and logged). A failing disk (EMFILE, ENOSPC) is not the records' fault: they are held in
        memory and retried from the writer thread, unless `keep` is False (the writer is closing)."""
        lines: list[bytes] = []
        kept: list[CallRecord] = []
        for record in records:
            try:
                lines.append(spool_line(record))
                kept.append(record)
            except Exception as exc:  # whatever the record holds, submit must not raise
                log.error("cannot spool call %s: %s", record.id, exc)
                self._count(records_lost=1)
        if not lines:
            return
        try:
            self._spool.append(b"".join(lines), len(lines))
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
            log.warning("database unavailable, spooling records to %s: %s", self._spool.directory, _reason(exc))
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
        records_written: int = 0,
        records_spooled: int = 0,
        records_rejected: int = 0,
        records_lost: int = 0,
        records_replayed: int = 0,
        records_unreadable: int = 0,
        spool_errors: int = 0,
        write_errors: int = 0,
    ) -> None:
        # The event loop thread and the writer thread both count; `+=` on an attribute is not atomic.
        with self._cond:
            self.records_written += records_written
            self.records_spooled += records_spooled
            self.records_rejected += records_rejected
            self.records_lost += records_lost
            self.records_replayed += records_replayed
            self.records_unreadable += records_unreadable
            self.spool_errors += spool_errors
            self.write_errors += write_errors
