"""The test suite's waiting helpers: framing holds however the bytes are split, and every wait ends in time."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.waiting import OutputLines, SocketReader, wait_until

FIRST = b"HTTP/1.1 200 OK\r\ncontent-length: 15\r\ncontent-type: application/json\r\n\r\n" + b'{"status":"ok"}'
SECOND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\n\r\n{}"


class SplitSocket:
    """A socket whose peer's bytes arrive in the given pieces, one per recv(), as a busy machine delivers them."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = list(pieces)

    def settimeout(self, timeout: float) -> None:
        pass

    def recv(self, size: int) -> bytes:
        if not self.pieces:
            raise TimeoutError
        piece = self.pieces.pop(0)
        self.pieces[:0] = [piece[size:]] if len(piece) > size else []
        return piece[:size]


@pytest.mark.parametrize("split", [1, 7, len(FIRST) - 15, len(FIRST), len(FIRST) + 3])
def test_http_responses_are_framed_however_they_are_split(split: int) -> None:
    stream = FIRST + SECOND
    reader = SocketReader(SplitSocket([stream[i : i + split] for i in range(0, len(stream), split)]))  # type: ignore[arg-type]
    assert reader.http_response() == (FIRST.partition(b"\r\n\r\n")[0], b'{"status":"ok"}')
    assert reader.http_response() == (SECOND.partition(b"\r\n\r\n")[0], b"{}")
    assert reader.buffer == b""


def test_a_message_that_never_completes_fails_at_the_deadline() -> None:
    reader = SocketReader(SplitSocket([FIRST[:-3]]))  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="timed out after 0s reading an HTTP response"):
        reader.http_response(timeout_s=0.2)


def test_a_closed_connection_is_not_a_message() -> None:
    reader = SocketReader(SplitSocket([FIRST[:20], b""]))  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="connection closed"):
        reader.http_response()


def test_wait_until_returns_the_condition_or_fails_naming_it() -> None:
    values = iter([0, None, 5])
    assert wait_until(lambda: next(values), 5, "a value", interval_s=0) == 5
    with pytest.raises(AssertionError, match="waiting for the impossible"):
        wait_until(lambda: False, 0.1, "the impossible")


def _child(code: str) -> OutputLines:
    process = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    return OutputLines(process)


def test_output_lines_waits_for_a_line_and_keeps_everything() -> None:
    output = _child("import sys\nfor i in range(20000): print(f'line {i}')\nprint('done', file=sys.stderr)")
    assert output.wait_for(lambda line: line == "done", 30, "the last line") == "done"
    assert output.finish().splitlines()[-2:] == ["line 19999", "done"]  # more than a pipe buffer, all of it


def test_output_lines_fails_at_once_when_the_process_exits_without_the_line() -> None:
    output = _child("print('starting'); raise SystemExit(3)")
    with pytest.raises(AssertionError, match=r"exited \(3\) before the ready line:\nstarting"):
        output.wait_for(lambda line: line == "ready", 60, "the ready line")
