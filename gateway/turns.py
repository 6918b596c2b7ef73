"""Order of calls within a trajectory, and which calls are retries of an earlier one.

OpenAI/Anthropic SDKs retry failed calls (sending `x-stainless-retry-count`), and clients may send an
`Idempotency-Key`; a retry must replace the attempt it repeats, not become a second turn. A retry reuses
that attempt's `seq`, and the store's upsert on (trajectory, seq, choice) does the replacing.
"""

from __future__ import annotations

import time
from collections import OrderedDict


class TurnCounter:
    """Hands out increasing sequence numbers per trajectory (nanosecond clock, so they order across restarts)."""

    def __init__(self, max_trajectories: int = 100_000) -> None:
        self._last: OrderedDict[str, int] = OrderedDict()
        self._by_key: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._max = max_trajectories

    def assign(self, trajectory_id: str, is_retry: bool, idempotency_key: str | None) -> int:
        if idempotency_key is not None:
            known = self._by_key.get((trajectory_id, idempotency_key))
            if known is not None:
                return known
        last = self._last.get(trajectory_id)
        if is_retry and last is not None:
            seq = last
        else:
            seq = time.time_ns() if last is None else max(time.time_ns(), last + 1)
        self._remember(self._last, trajectory_id, seq)
        if idempotency_key is not None:
            self._remember(self._by_key, (trajectory_id, idempotency_key), seq)
        return seq

    def _remember(self, table: OrderedDict, key: object, seq: int) -> None:  # type: ignore[type-arg]
        table[key] = seq
        table.move_to_end(key)
        if len(table) > self._max:
            table.popitem(last=False)
