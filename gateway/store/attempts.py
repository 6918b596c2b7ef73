"""Which attempts are one call: a client's retry is matched to the attempt it repeats by content, in the store.

A per-process turn counter cannot do this: the first attempt may never have reached this gateway (a reset connection,
another gateway behind a load balancer), the retry may come after a later turn of the same trajectory, and records
reach the database in any order (the spool replays late). So the rule is a function of what the records say:

- A call is a chain of attempts of the same request (same `request_hash`: run, endpoint and canonical body, within
  one trajectory) whose `x-stainless-retry-count` rises with time. An attempt with retry count k > 0 continues the
  earliest call whose newest attempt came before it with a lower count; one with count 0 (not flagged) never
  continues anything, so identical requests sent as separate turns (parallel sampling) stay separate turns. A
  flagged retry that continues nothing is a new turn (its first attempt was never seen).
- An `Idempotency-Key` names the call: every attempt with the same key (in the trajectory) is one call.
- A call has one row per choice, holding its newest attempt (by created_at: the one the client saw answered), at
  that attempt's seq. The row remembers the earliest attempt it stands for (`first_seq`, `first_retry_count`), so an
  earlier attempt that arrives late (or is replayed again) is recognised as part of it instead of becoming a turn.

Processing attempts in seq order gives the canonical result; an attempt arriving out of order joins the call it would
have joined in order, so the final rows do not depend on arrival order (tests/gateway/store/test_retries.py checks every
order of each scenario; tests/gateway/store/test_attempts.py generated ones). Identical requests of one trajectory in
flight at once are the ambiguity content cannot resolve: a retry may be paired with the other identical call (same body,
so only which seq holds which answer differs); a retry whose first attempt was lost looks exactly like a retry of an
earlier identical call and replaces it; and when such retries also reach the database out of order, a call can be left
as two rows. An Idempotency-Key per call removes the ambiguity.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import orjson

from gateway.store.call_record import CallRecord


def request_hash(record: CallRecord) -> bytes | None:
    """What identifies the request a record answers, within its trajectory: the Idempotency-Key when the client sent
    one, else run, endpoint and the body's canonical bytes (keys sorted, so a client that re-serialises differently
    still matches). Computed by the writer, off the response path."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{record.trajectory_id}\0{record.run}\0".encode())
    if record.idempotency_key is not None:
        digest.update(b"key\0" + record.idempotency_key.encode())
    elif record.request is not None:
        digest.update(f"body\0{record.endpoint}\0".encode())
        digest.update(orjson.dumps(record.request, option=orjson.OPT_SORT_KEYS))
    else:
        return None
    return digest.digest()


@dataclass(slots=True)
class Attempt:
    """One seq of a trajectory as the matching sees it: a stored row's call, or an incoming attempt."""

    seq: int
    request_hash: bytes | None
    retry_count: int
    created_at: float
    keyed: bool
    first_seq: int  # the earliest attempt of the call this stands for (itself, for an attempt on its own)
    first_retry_count: int


@dataclass(slots=True)
class Settlement:
    """What to do in the database: incoming seqs not to write, stored seqs whose rows go, and the earliest attempt
    (first_seq, first_retry_count) of every call that survives."""

    dropped: set[int] = field(default_factory=set)
    removed: set[int] = field(default_factory=set)
    first: dict[int, tuple[int, int]] = field(default_factory=dict)


def settle(stored: Iterable[Attempt], incoming: Iterable[Attempt]) -> Settlement:
    """Fold incoming attempts (one trajectory, distinct seqs) into the calls already stored."""
    calls = {attempt.seq: attempt for attempt in stored}
    stored_seqs = set(calls)
    incoming_seqs: set[int] = set()
    result = Settlement()
    for attempt in sorted(incoming, key=lambda a: a.seq):
        incoming_seqs.add(attempt.seq)
        same = calls.get(attempt.seq)
        if same is not None:
            # The same attempt again (a replay, another choice of it) or, from an older gateway, a retry that reused
            # its attempt's seq: the rows at this seq are upserted, newest attempt winning, as they always were.
            newest = max((same, attempt), key=lambda a: a.created_at)
            same.retry_count, same.created_at = newest.retry_count, newest.created_at
            if (attempt.first_seq, attempt.first_retry_count) < (same.first_seq, same.first_retry_count):
                same.first_seq, same.first_retry_count = attempt.first_seq, attempt.first_retry_count
            continue
        members = _same_call(attempt, calls.values()) + [attempt]
        winner = max(members, key=lambda a: (a.created_at, a.seq))
        earliest = min(members, key=lambda a: (a.first_seq, a.first_retry_count))
        winner.first_seq, winner.first_retry_count = earliest.first_seq, earliest.first_retry_count
        for member in members:
            if member is winner:
                continue
            calls.pop(member.seq, None)
            if member.seq in stored_seqs:
                result.removed.add(member.seq)
            if member.seq in incoming_seqs:
                result.dropped.add(member.seq)
        calls[winner.seq] = winner
    result.first = {seq: (call.first_seq, call.first_retry_count) for seq, call in calls.items()}
    return result


def _same_call(attempt: Attempt, calls: Iterable[Attempt]) -> list[Attempt]:
    """The calls `attempt` is an attempt of: all with its key; else the one whose attempts it falls between, or
    the earliest call it continues and the earliest it precedes (it bridges two when attempt 1 comes after 0 and 2)."""
    if attempt.request_hash is None:
        return []
    candidates = [call for call in calls if call.request_hash == attempt.request_hash]
    if attempt.keyed:
        return candidates
    # Retry counts rise strictly along a call's attempts, so an attempt with the count of one already there is not
    # part of it (two identical parallel calls, each retried once), unless it is that very attempt again.
    inside = [
        call
        for call in candidates
        if (attempt.seq, attempt.retry_count) == (call.first_seq, call.first_retry_count)
        or (
            call.first_seq < attempt.seq < call.seq
            and call.first_retry_count < attempt.retry_count < call.retry_count
        )
    ]
    if inside:
        return [min(inside, key=lambda c: c.first_seq)]
    continues = [c for c in candidates if c.seq < attempt.seq and c.retry_count < attempt.retry_count]
    precedes = [c for c in candidates if attempt.seq < c.first_seq and attempt.retry_count < c.first_retry_count]
    return [min(group, key=lambda c: c.first_seq) for group in (continues, precedes) if group]
