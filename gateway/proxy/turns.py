"""The order of calls within a trajectory: `seq`, a nanosecond wall clock read when a call arrives.

Which calls are retries of an earlier one is not decided here: a per-process counter cannot know about attempts
another gateway process saw, or that never arrived. The store matches a retry to the attempt it repeats by content
(gateway.store.attempts); the gateway only stamps each call with a seq and passes on the client's retry headers.
"""

from __future__ import annotations

import time


class SeqClock:
    """`time.time_ns()`, made strictly increasing within the process, so two calls of one trajectory arriving in the
    same nanosecond still get distinct seqs (distinct rows) and seqs order across restarts."""

    def __init__(self) -> None:
        self._last = 0

    def next(self) -> int:
        self._last = max(time.time_ns(), self._last + 1)
        return self._last
