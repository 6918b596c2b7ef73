"""Waiting on what another process or thread does, the only ways tests here do it: poll a condition up to a
deadline, read a socket until a whole message is framed, drain a child's output and wait for a line in it.

A busy machine splits writes across reads and delays everything; a sleep or one `recv()` taken as a whole message
passes on an idle machine and fails on a loaded one (issue 23).
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.05) -> T:
    """Poll `condition` until it returns something truthy (returned), failing with `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)


class SocketReader:
    """Reads a socket into a buffer until a framed message is complete; bytes beyond it stay for the next one."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def until(self, complete: Callable[[bytes], int | None], timeout_s: float, what: str) -> bytes:
        """Read until `complete(buffer)` gives the length of a whole message; return it and keep the rest."""
        deadline = time.monotonic() + timeout_s
        while (end := complete(self.buffer)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out after {timeout_s:.0f}s reading {what}; got {self.buffer[:2000]!r}")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                raise AssertionError(f"connection closed while reading {what}; got {self.buffer[:2000]!r}")
            self.buffer += chunk
        message, self.buffer = self.buffer[:end], self.buffer[end:]
        return message

    def http_response(self, timeout_s: float = 10) -> tuple[bytes, bytes]:
        """One HTTP/1.1 response with a Content-Length body: (status line and headers, body)."""
        message = self.until(_http_message_end, timeout_s, "an HTTP response")
        head, _, body = message.partition(b"\r\n\r\n")
        return head, body


def _http_message_end(buffer: bytes) -> int | None:
    head_end = buffer.find(b"\r\n\r\n")
    if head_end < 0:
        return None
    length = 0
    for line in buffer[:head_end].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
        elif name.strip().lower() == b"transfer-encoding":
            raise AssertionError("a chunked response: frame it with SocketReader.until")
    end = head_end + 4 + length
    return end if len(buffer) >= end else None


class OutputLines:
    """Drains a child's merged stdout/stderr in a thread (a pipe nobody reads blocks the child once it is full)
    and keeps its lines, so a test can wait for one without ever blocking on the pipe itself."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        if process.stdout is None:
            raise ValueError("start the process with stdout=subprocess.PIPE, text=True")
        self.process = process
        self.lines: list[str] = []
        self._stdout = process.stdout
        self._thread = threading.Thread(target=self._drain, name=f"output-{process.pid}", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        for line in self._stdout:
            self.lines.append(line.rstrip("\n"))

    def text(self, last: int | None = None) -> str:
        return "\n".join(self.lines[-last:] if last else self.lines)

    def wait_for(self, predicate: Callable[[str], bool], timeout_s: float, what: str) -> str:
        """The first line satisfying `predicate`; fails if the process exits first or the deadline passes."""
        deadline = time.monotonic() + timeout_s
        seen = 0
        while True:
            lines = self.lines[seen:]  # the list only grows, so this slice is a consistent snapshot
            for line in lines:
                if predicate(line):
                    return line
            seen += len(lines)
            exited = self.process.poll() is not None
            if exited and not self._thread.is_alive() and seen == len(self.lines):
                raise AssertionError(f"exited ({self.process.returncode}) before {what}:\n{self.text(50)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}:\n{self.text(50)}")
            time.sleep(0.05)

    def finish(self, timeout_s: float = 10) -> str:
        """Everything the process wrote, once it has exited and the pipe is drained."""
        self.process.wait(timeout_s)
        self._thread.join(timeout_s)
        return self.text()
