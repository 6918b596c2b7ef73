"""Background work that gives way to the event loop it shares a core and the GIL with.

The writer thread runs each batch's Python work (settling attempts, lineage, rows, JSON) on the gateway's core. Left
alone it holds the GIL and the core for milliseconds at a stretch, and a call that arrives meanwhile waits for it: the
c=1 and s=1 p99 of bench/gateway_overhead.py were that wait (bench/README.md, issue 18). A shorter switch interval
does not help, because the writer takes the GIL back at each of the event loop's system calls. So within a
`giving_way` block the thread sleeps for a moment whenever it has run a slice since it last did, at the yield points
its work passes (`give_way`), and the event loop takes the core and the GIL in that gap.

The pauses are not free (a sleep, the GIL handed back and forth), so the writer gives way only while few calls are in
flight and the gateway is not quiet, and for less the more records are queued behind the batch it writes, down to a
moment: asleep at all, it hands the GIL over (gateway.recorder.writer.RecordWriter._pause). Both change within one
batch, so the pause is asked at the end of each slice. A writer that stopped pausing once behind kept the GIL for up to
the interpreter's switch interval (5 ms) at each of the event loop's system calls, and at c=1 it was behind for good:
the gateway's c=1 p99 was that.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def _no_pause() -> float:
    return 0.0


class _Opt(threading.local):
    # Class defaults, so a thread outside any block reads them without the cost of a missing attribute.
    slice_s = 0.0
    pause: Callable[[], float] = staticmethod(_no_pause)
    since = 0.0


_thread = _Opt()


@contextmanager
def giving_way(slice_s: float, pause: Callable[[], float]) -> Iterator[None]:
    """Within the block, `give_way` on this thread sleeps `pause()` seconds after each `slice_s` of running (a slice
    of 0: never; a pause of 0: not this time). `pause` is asked at the end of each slice, not once for the block,
    because whether the event loop needs the core changes within one batch. Other threads are unaffected."""
    previous = (_thread.slice_s, _thread.pause)
    _thread.slice_s, _thread.pause, _thread.since = slice_s, pause, time.perf_counter()
    try:
        yield
    finally:
        _thread.slice_s, _thread.pause = previous


def give_way() -> None:
    """A yield point between two units of work; free outside a `giving_way` block."""
    slice_s = _thread.slice_s
    if not slice_s:
        return
    if time.perf_counter() - _thread.since >= slice_s:
        seconds = _thread.pause()
        if seconds > 0:
            time.sleep(seconds)
        _thread.since = time.perf_counter()
