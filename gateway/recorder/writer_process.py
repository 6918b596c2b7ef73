"""The record writer's database work in a process of its own (`TRAJGATE_WRITER_PROCESS`, Postgres only).

The writer thread shares the gateway's GIL and its core. Measured at c=1 with probes in the gateway (bench/README.md),
the writer's batches are the whole of its latency tail (p99 1.0 ms with their database work skipped, 4.2-4.7 ms
with it). Where the machine has a core to spare, a process of its own takes that work off the event loop's GIL and
core. On one core shared with the event loop (the benchmark's layout) it cannot help: at the same priority it
takes the core as the thread did, and at a lower one (`TRAJGATE_WRITER_NICE`) records reach the database later
under load, with no relief thread to take over as the writer thread has (bench/README.md has the figures). So it is
off by default.

The writer thread keeps everything else (the queue, batching, the write-ahead log, retries and replay): for each
batch it sends the records' spool lines down a pipe and waits, without the GIL, for the answer: stored, the
database is unavailable, or a record in the batch is refused. A child that dies is started again with the next
batch; the batch it held is treated as a database outage (let go from memory, stored by replaying the log).

Frames both ways: a 4-byte little-endian length, then the bytes. A request is the batch's spool lines
(`gateway.recorder.spool_lines.spool_line`), one per record; an empty answer is success, anything else JSON
`{"reason": str, "record": bool}`.
"""

from __future__ import annotations

import logging
import os
import struct
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import IO

import orjson

from gateway.recorder.spool_lines import WriteFailed

log = logging.getLogger("trajgate.writer")

_FRAME = struct.Struct("<I")
_URL_ENV = "TRAJGATE_WRITER_PROCESS_URL"
_NICE_ENV = "TRAJGATE_WRITER_PROCESS_NICE"


class WriterProcess:
    """The parent's end: one child at a time, started on first use and again after it dies. Used by one thread."""

    def __init__(self, url: str, nice: int) -> None:
        self._url = url
        self._nice = nice
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()  # write() from the writer thread, close() from whoever shuts down
        self.starts = 0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Start the child now, so its imports are done before the first batch comes."""
        with self._lock:
            self._running()

    def write(self, lines: Sequence[bytes]) -> None:
        """Store the records these spool lines hold, in one transaction; raises WriteFailed."""
        with self._lock:
            try:
                proc = self._running()
            except OSError as exc:  # no process (EMFILE, EAGAIN): an outage, never the records' fault
                raise WriteFailed(f"cannot start the writer process: {exc}", record=False) from exc
            assert proc.stdin is not None and proc.stdout is not None
            try:
                _send(proc.stdin, lines)
                answer = _receive(proc.stdout)
            except (OSError, ValueError, EOFError) as exc:
                self._stop(proc)
                raise WriteFailed(f"the writer process ended ({exc or type(exc).__name__})", record=False) from exc
        if answer:
            failure = orjson.loads(answer)
            raise WriteFailed(failure["reason"], record=bool(failure["record"]))

    def close(self, timeout_s: float = 10.0) -> None:
        """End the child. If a batch is still being written (the writer thread gave up waiting for it), the child is
        killed: that batch is in the log, for the next start to replay."""
        if self._lock.acquire(timeout=timeout_s):
            try:
                if self._proc is not None:
                    self._stop(self._proc, timeout_s)
            finally:
                self._lock.release()
        elif self._proc is not None:
            self._proc.kill()

    def _running(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        if self._proc is not None:
            log.error("the writer process exited with status %s; starting another", self._proc.returncode)
        env = {**os.environ, _URL_ENV: self._url, _NICE_ENV: str(self._nice)}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.recorder.writer_process"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        self.starts += 1
        return self._proc

    def _stop(self, proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
        """End the child: closing its input ends it after the batch it holds; killed if it does not."""
        for stream in (proc.stdin, proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if self._proc is proc:
            self._proc = None


def _send(stream: IO[bytes], lines: Sequence[bytes]) -> None:
    payload = b"".join(lines)
    stream.write(_FRAME.pack(len(payload)))
    stream.write(payload)
    stream.flush()


def _receive(stream: IO[bytes]) -> bytes:
    header = _read_exactly(stream, _FRAME.size)
    return _read_exactly(stream, _FRAME.unpack(header)[0])


def _read_exactly(stream: IO[bytes], size: int) -> bytes:
    data = stream.read(size)
    if data is None or len(data) != size:
        raise EOFError("the other end closed the pipe")
    return data


def main() -> int:
    """The child: read batches, store them, answer, until the parent closes the pipe."""
    os.nice(int(os.environ.get(_NICE_ENV, "0")))
    # The protocol owns the original stdout; anything printed goes to stderr, with the parent's logs.
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = os.fdopen(0, "rb")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from gateway.recorder.spool_lines import is_record_error, read_spool_record, reason
    from gateway.recorder.threads import name_os_thread
    from gateway.store.db import make_engine
    from gateway.store.records import LineageCache, write_calls

    threading.current_thread().name = "trajgate-store"
    name_os_thread()
    engine = make_engine(os.environ[_URL_ENV], pool_size=1, max_overflow=0)
    lineage = LineageCache()  # the calls this process wrote, as the writer thread keeps them when it writes itself
    try:
        while True:
            try:
                payload = _receive(requests)
            except EOFError:
                return 0
            try:
                read = [read_spool_record(line) for line in payload.split(b"\n") if line]
                write_calls(engine, [record for record, _ in read], lineage, [packed for _, packed in read])
                answer = b""
            except Exception as exc:  # every failure is the parent's to sort: outage or refused record
                answer = orjson.dumps({"reason": reason(exc), "record": is_record_error(exc)})
            answers.write(_FRAME.pack(len(answer)) + answer)
            answers.flush()
    finally:
        engine.dispose()


if __name__ == "__main__":
    sys.exit(main())
