"""Background work that gives way to the event loop it shares a core and the GIL with.

The writer thread runs each batch's Python work (settling attempts, lineage, rows, JSON) on the gateway's core. Left
alone it holds the GIL and the core for milliseconds at a stretch, and a call that arrives meanwhile waits for it: the
c=1 and s=1 p99 of bench/gateway_overhead.py were that wait (bench/README.md, issue 18). A shorter switch interval
does not help, because the writer takes the GIL back at each of the event loop's system calls. So within a
`giving_way` block the thread sleeps for a moment whenever it has run a slice since it last did, at the yield points
its work passes (`give_way`), and the event loop takes the core and the GIL in that gap.

The pauses are not free (a sleep, the GIL handed back and forth), and a thread that gives the GIL up gets it back from
a busy event loop only at the interpreter's forced switch (every 5 ms). So the writer gives way only while few calls
are in flight and little is queued behind the batch it writes (gateway.recorder.writer.RecordWriter._gives_way).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class _Opt(threading.local):
    # Class defaults, so a thread outside any block reads them without the cost of a missing attribute.
    slice_s = 0.0
    pause_s = 0.0
    since = 0.0


_thread = _Opt()


@contextmanager
def giving_way(slice_s: float, pause_s: float) -> Iterator[None]:
    """Within the block, `give_way` on this thread sleeps `pause_s` after each `slice_s` of running (a slice of 0:
    never). Other threads are unaffected."""
    previous = (_thread.slice_s, _thread.pause_s)
    _thread.slice_s, _thread.pause_s, _thread.since = slice_s, pause_s, time.perf_counter()
    try:
        yield
    finally:
        _thread.slice_s, _thread.pause_s = previous


def give_way() -> None:
    """A yield point between two units of work; free outside a `giving_way` block."""
    slice_s = _thread.slice_s
    if not slice_s:
        return
    if time.perf_counter() - _thread.since >= slice_s:
        time.sleep(_thread.pause_s)
        _thread.since = time.perf_counter()
