"""The retry matching rule on its own (gateway.store.attempts), over many generated trajectories: attempts arriving one
at a time in any order settle into the same calls as all of them at once, and into the calls the client made."""

from __future__ import annotations

import random

import pytest

from gateway.store.attempts import Attempt, settle


def _attempt(seq: int, body: str, retry_count: int, keyed: bool = False) -> Attempt:
    return Attempt(seq, body.encode(), retry_count, float(seq), keyed, seq, retry_count)


def _arrive(stored: dict[int, Attempt], attempts: list[Attempt]) -> None:
    """What write_calls does with a batch, on an in-memory table of calls keyed by seq."""
    settlement = settle(list(stored.values()), attempts)
    for seq in settlement.removed:
        del stored[seq]
    for attempt in attempts:
        if attempt.seq not in settlement.dropped and attempt.seq not in stored:
            stored[attempt.seq] = attempt
    for seq, (first_seq, first_retry_count) in settlement.first.items():
        stored[seq].first_seq, stored[seq].first_retry_count = first_seq, first_retry_count


def _copy(attempt: Attempt) -> Attempt:
    return Attempt(*(getattr(attempt, name) for name in Attempt.__slots__))  # type: ignore[attr-defined]


def _trajectory(rng: random.Random) -> tuple[list[Attempt], set[int]]:
    """Calls with distinct bodies (or keys), each a few attempts with rising retry counts, interleaved in time; the
    first attempts of some never arrive. Returns the attempts that arrive and the seq of each call's last one."""
    attempts: list[Attempt] = []
    answered: set[int] = set()
    clock = 0
    for call in range(rng.randint(1, 5)):
        clock += rng.randint(1, 3)
        seq = clock
        lost_first = rng.random() < 0.25
        keyed = rng.random() < 0.2
        tries = rng.randint(2 if lost_first else 1, 4)
        for retry_count in range(tries):
            if not (lost_first and retry_count == 0):
                # Times in tenths plus the call's number: two attempts never share a seq (a nanosecond clock).
                attempts.append(_attempt(seq * 10 + call, f"body-{call}", retry_count if not keyed else 0, keyed))
            seq += rng.randint(1, 20)  # later calls may start between this call's attempts
        answered.add(attempts[-1].seq)
    return attempts, answered


@pytest.mark.parametrize("seed", range(300))
def test_attempts_in_any_order_settle_into_the_calls_the_client_made(seed: int) -> None:
    rng = random.Random(seed)
    attempts, answered = _trajectory(rng)
    at_once: dict[int, Attempt] = {}
    _arrive(at_once, [_copy(a) for a in attempts])
    assert set(at_once) == answered

    for _ in range(5):
        order = [_copy(a) for a in attempts]
        rng.shuffle(order)
        one_by_one: dict[int, Attempt] = {}
        for attempt in order:
            _arrive(one_by_one, [attempt])
        assert {seq: (a.first_seq, a.first_retry_count) for seq, a in one_by_one.items()} == {
            seq: (a.first_seq, a.first_retry_count) for seq, a in at_once.items()
        }


def test_identical_requests_without_a_retry_flag_stay_apart_in_any_order() -> None:
    attempts = [_attempt(seq, "same", 0) for seq in (1, 2, 3)]
    for order in ([0, 1, 2], [2, 1, 0], [1, 2, 0]):
        stored: dict[int, Attempt] = {}
        for index in order:
            _arrive(stored, [_copy(attempts[index])])
        assert sorted(stored) == [1, 2, 3]
