"""One recorded call read back whole by its id: the request as the model saw it and the response it got.

APIs the gateway translates to chat at the edge (OpenAI Responses) find an earlier answer this way, to continue it
(`previous_response_id`) or return it again (`GET /v1/responses/{id}`), when this process no longer holds it in memory
(another gateway answered it, or this one restarted).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, select

from gateway.store.lineage import StoredCall, StoredCalls
from gateway.store.models import Call


@dataclass(frozen=True, slots=True)
class RecordedExchange:
    call_id: str
    run: str
    endpoint: str
    status_code: int | None
    request: dict[str, Any] | None  # whole: the messages it shares with its predecessor are put back
    response: dict[str, Any] | None
    created_at: datetime


def recorded_exchange(engine: Engine, call_id: str) -> RecordedExchange | None:
    """The call (choice 0) with this id, its request rebuilt from the linear message storage; None if not written.

    A stored request may hold only the messages past those its predecessor's request shares, so the trajectory's
    earlier calls are read too, and the request is put back along its chain of storage parents.
    """
    with engine.connect() as conn:
        found = conn.execute(select(Call.trajectory_id, Call.seq).where(Call.id == call_id)).first()
        if found is None:
            return None
        rows = conn.execute(
            select(
                Call.id,
                Call.seq,
                Call.run,
                Call.endpoint,
                Call.status_code,
                Call.request,
                Call.response,
                Call.created_at,
                Call.messages_parent_seq,
                Call.messages_prefix_len,
            ).where(Call.trajectory_id == found.trajectory_id, Call.seq <= found.seq, Call.choice_index == 0)
        ).all()
    row = next((row for row in rows if row.id == call_id), None)
    if row is None:
        return None
    stored = StoredCalls(
        {
            (r.seq, 0): StoredCall(None, None, None, None, r.request, r.messages_parent_seq, r.messages_prefix_len)
            for r in rows
        }
    )
    request = stored.request((row.seq, 0))
    return RecordedExchange(row.id, row.run, row.endpoint, row.status_code, request, row.response, row.created_at)
