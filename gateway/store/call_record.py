"""What the gateway hands the writer for each upstream call: plain data, cheap to build on the hot path.

Token ids and logprobs stay Python lists here; they are packed into the columns' bytes once, for the record's
write-ahead log line, and the writer stores those (gateway.store.arrays.PackedArrays). The line
(gateway.recorder.spool_lines) is how a record waits on disk while the database is away.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class CallRecord:
    id: str
    run: str
    base_model: str
    trajectory_id: str
    group_id: str
    group_size: int | None
    mode: str
    seq: int
    choice_index: int
    policy_version: int
    endpoint: str
    stream: bool
    request: dict[str, Any] | None
    response: dict[str, Any] | None
    prompt_token_ids: list[int] | None
    completion_token_ids: list[int] | None
    completion_logprobs: list[float] | None
    finish_reason: str | None
    usage: dict[str, Any] | None
    status_code: int | None
    error: str | None
    trainable: bool
    untrainable_reason: str | None
    latency_ms: float | None
    ttft_ms: float | None
    retry_count: int
    idempotency_key: str | None
    created_at: float
    # token_in runs only (gateway.proxy.token_in); absent from records spooled before they existed. The predecessor is the
    # recorded call (seq, choice) whose exact ids the prompt continues: the writer's lineage compares against it
    # rather than the previous seq, which a retry or a parallel branch of the same turn is not built on.
    history_key: str | None = None
    segment_reason: str | None = None
    predecessor_seq: int | None = None
    predecessor_choice: int | None = None
    # The gateway made the trajectory id up (the call carried none): no later call is expected to continue it, so the
    # writer keeps nothing of it for one (its lineage cache, the request's message digests). A client that reuses the
    # id from the response's X-Trajectory-Id still gets a correct lineage, from the stored row.
    generated_trajectory: bool = False

