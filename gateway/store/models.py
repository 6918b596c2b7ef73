"""The schema as SQLAlchemy 2 models; the Alembic migrations must agree with it (a test checks).

Portable across Postgres and SQLite: JSON becomes JSONB on Postgres, token arrays are bytes everywhere.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

ID_LENGTH = 128

JsonType = JSON().with_variant(JSONB(), "postgresql")

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Run(Base):
    """A named training run; agents name it in the request's `model` field."""

    __tablename__ = "runs"

    name: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    base_model: Mapped[str] = mapped_column(String(512))
    # What the trainer loads: the same weights vLLM serves as base_model, or the IS ratio is meaningless.
    base_weights: Mapped[str | None] = mapped_column(String(1024))
    config: Mapped[dict[str, Any]] = mapped_column(JsonType, default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, onupdate=utcnow)


class PolicyVersion(Base):
    """Step k of a run as vLLM serves it: step 0 is the base model, later steps are adapters `run@k`."""

    __tablename__ = "policy_versions"

    run: Mapped[str] = mapped_column(ForeignKey("runs.name", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    served_name: Mapped[str] = mapped_column(String(512))
    adapter_path: Mapped[str | None] = mapped_column(String(1024))
    # loading (a vLLM adapter slot claimed, gateway/store/adapter_slots.py; not routed to) -> loaded -> retiring (no
    # longer routed to; still in vLLM until every live gateway reloaded its routes) -> unloaded
    status: Mapped[str] = mapped_column(String(16), default="loaded")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # Seconds since the epoch on the database's clock, taken once the retirement committed (trainer/worker/publish.py).
    retired_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class Group(Base):
    """Trajectories scored against each other; the unit the trainer claims.

    state: open -> ready -> claimed -> trained | dropped. A claim whose lease expires goes back to ready if the
    group is still complete, else to open; a trajectory joining a claimed, trained or dropped group reopens it
    (after the step, for a claimed one), and its next claim trains only trajectories no step has trained.
    """

    __tablename__ = "groups"

    group_id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    run: Mapped[str] = mapped_column(ForeignKey("runs.name", ondelete="CASCADE"))
    mode: Mapped[str] = mapped_column(String(8), default="train")
    expected_size: Mapped[int | None] = mapped_column(Integer)
    closed: Mapped[bool] = mapped_column(Boolean, default=False)
    state: Mapped[str] = mapped_column(String(16), default="open")
    claimed_by: Mapped[str | None] = mapped_column(String(256))
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    trained_step: Mapped[int | None] = mapped_column(Integer)
    drop_reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    ready_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (Index(None, "run", "state", "ready_at"),)


class Trajectory(Base):
    """One agent episode: the calls it made and the reward it earned."""

    __tablename__ = "trajectories"

    trajectory_id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    run: Mapped[str] = mapped_column(ForeignKey("runs.name", ondelete="CASCADE"))
    group_id: Mapped[str] = mapped_column(ForeignKey("groups.group_id", ondelete="CASCADE"))
    mode: Mapped[str] = mapped_column(String(8), default="train")
    reward: Mapped[float | None] = mapped_column(Float)
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JsonType)
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", JsonType)
    untrainable_calls: Mapped[int] = mapped_column(Integer, default=0)
    # The step that trained it; a group reopened by a late trajectory trains only those still None.
    trained_step: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    rewarded_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (Index(None, "group_id"), Index(None, "run", "created_at"))


# What `Call.endpoint` holds: which OpenAI endpoint a call came in on, and so the shape of its request and response.
# Defined here, with the column, because reading a stored call depends on it (gateway.store.reads).
CHAT = "chat"
COMPLETIONS = "completions"


class Call(Base):
    """One upstream call (one row per choice when n > 1), with the exact ids and logprobs vLLM produced."""

    __tablename__ = "calls"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    trajectory_id: Mapped[str] = mapped_column(ForeignKey("trajectories.trajectory_id", ondelete="CASCADE"))
    # Order within the trajectory (the gateway's nanosecond clock at receipt). A call's row sits at the seq of the
    # attempt it holds: the newest, the one the client saw answered (gateway.store.attempts).
    seq: Mapped[int] = mapped_column(BigInteger)
    choice_index: Mapped[int] = mapped_column(Integer, default=0)
    run: Mapped[str] = mapped_column(String(ID_LENGTH))
    policy_version: Mapped[int] = mapped_column(Integer, default=0)
    endpoint: Mapped[str] = mapped_column(String(64))  # CHAT or COMPLETIONS: the shape of the stored request
    stream: Mapped[bool] = mapped_column(Boolean, default=False)
    request: Mapped[dict[str, Any] | None] = mapped_column(JsonType)
    response: Mapped[dict[str, Any] | None] = mapped_column(JsonType)
    prompt_token_ids: Mapped[bytes | None] = mapped_column(LargeBinary)
    completion_token_ids: Mapped[bytes | None] = mapped_column(LargeBinary)
    completion_logprobs: Mapped[bytes | None] = mapped_column(LargeBinary)
    finish_reason: Mapped[str | None] = mapped_column(Text)  # the upstream's word, as sent (unbounded since 0011)
    usage: Mapped[dict[str, Any] | None] = mapped_column(JsonType)
    status_code: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    trainable: Mapped[bool] = mapped_column(Boolean, default=False)
    untrainable_reason: Mapped[str | None] = mapped_column(Text)
    latency_ms: Mapped[float | None] = mapped_column(Float)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    retry_count: Mapped[int] = mapped_column(Integer, default=0)
    idempotency_key: Mapped[str | None] = mapped_column(String(256))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # Merge diagnostics against the predecessor (gateway.store.lineage); null on calls written before 0004.
    merge_reason: Mapped[str | None] = mapped_column(String(32))
    divergence: Mapped[int | None] = mapped_column(Integer)
    # Linear storage: prompt_token_ids holds only the ids past the first prefix_len, which are the leading ids of
    # choice 0's prompt + completion at parent_seq in the same trajectory. No parent: the whole prompt is stored.
    parent_seq: Mapped[int | None] = mapped_column(BigInteger)
    prefix_len: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # token_in runs (gateway.proxy.token_in): hash of the messages answered plus the assistant message returned, by which
    # the next call finds this one; and why the call started a new token sequence (null when it continued one).
    history_key: Mapped[str | None] = mapped_column(String(64))
    segment_reason: Mapped[str | None] = mapped_column(String(32))
    # The same for the request's chat messages (gateway.store.messages): `request` holds only the messages past the
    # first messages_prefix_len, which are the leading messages of choice 0's full request at messages_parent_seq.
    messages_parent_seq: Mapped[int | None] = mapped_column(BigInteger)
    messages_prefix_len: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Retry matching (gateway.store.attempts): the request's identity in its trajectory, and the earliest attempt of
    # the call this row stands for. Null on calls written before 0007, which are never matched.
    request_hash: Mapped[bytes | None] = mapped_column(LargeBinary)
    first_seq: Mapped[int | None] = mapped_column(BigInteger)
    first_retry_count: Mapped[int | None] = mapped_column(Integer)
    # The call tree (gateway.store.tree): the recorded call whose prompt + completion ids this call's prompt extends
    # the furthest (null: a root, `merge_reason` says why), and this call's own prompt + completion as a candidate
    # parent for later calls: their count and a hash of them. Null on calls written before 0009.
    tree_parent_seq: Mapped[int | None] = mapped_column(BigInteger)
    tree_parent_choice: Mapped[int | None] = mapped_column(Integer)
    tokens_len: Mapped[int | None] = mapped_column(Integer)
    tokens_key: Mapped[bytes | None] = mapped_column(LargeBinary)

    __table_args__ = (
        UniqueConstraint("trajectory_id", "seq", "choice_index"),
        Index(None, "trajectory_id", "history_key"),
    )


class TrainerLease(Base):
    """Which trainer process trains a run: one at a time, renewed while it lives, taken over once it expires."""

    __tablename__ = "trainer_leases"

    run: Mapped[str] = mapped_column(ForeignKey("runs.name", ondelete="CASCADE"), primary_key=True)
    holder: Mapped[str] = mapped_column(String(256))
    lease_until: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    acquired_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Admission(Base):
    """A training group the gateway admitted (gateway/proxy/admit.py): once per group, whichever gateway did it.

    What counts against the run's bound is read from here joined to groups (a group trained or dropped no longer
    counts), so every gateway on the database shares one bound.
    """

    __tablename__ = "admissions"

    group_id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    run: Mapped[str] = mapped_column(ForeignKey("runs.name", ondelete="CASCADE"))
    # The policy version serving the run when the group was admitted.
    policy_version: Mapped[int] = mapped_column(Integer)
    admitted_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # How long the call that asked for it waited for room.
    wait_s: Mapped[float] = mapped_column(Float, default=0.0)

    __table_args__ = (Index(None, "run", "policy_version"),)


class AdmissionRefusal(Base):
    """Per run, the calls admission turned away: at once (`admission: reject`) or after waiting (timed out)."""

    __tablename__ = "admission_refusals"

    run: Mapped[str] = mapped_column(ForeignKey("runs.name", ondelete="CASCADE"), primary_key=True)
    rejected: Mapped[int] = mapped_column(Integer, default=0)
    timed_out: Mapped[int] = mapped_column(Integer, default=0)


class TrainStep(Base):
    """What one optimizer step did, for the read API and the live progress stream."""

    __tablename__ = "train_steps"

    run: Mapped[str] = mapped_column(ForeignKey("runs.name", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    metrics: Mapped[dict[str, Any]] = mapped_column(JsonType, default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class GatewayPeer(Base):
    """A live gateway process and how far its record writer has caught up (gateway/recorder/heartbeat.py): rewards, closes and
    judge requests on any gateway wait for every other one's calls answered before they arrived.

    `started_at` and `seen_at` are seconds since the epoch on the database's clock (gateways need not agree on theirs);
    `flushed_through` is a moment, a value of the Postgres sequence `gateway_peers_moment` (gateway.store.peers).
    """

    __tablename__ = "gateway_peers"

    gateway_id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    started_at: Mapped[float] = mapped_column(Float)
    seen_at: Mapped[float] = mapped_column(Float)
    # Every call this gateway answered before this time is in the database; null until its first flush.
    flushed_through: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # The database's clock just before this gateway last read its route table: versions retired before it are no
    # longer routed to by this gateway (trainer/worker/publish.py unloads them once every live gateway is past them).
    routes_read_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class UiSession(Base):
    """A web UI login (gateway/store/ui_sessions.py): the cookie is a random id, of which only the SHA-256 is kept. It ends
    at `expires_at`, at logout (`revoked_at`), or when the admin key changes (`admin_key_hash` no longer matches)."""

    __tablename__ = "ui_sessions"

    id_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    admin_key_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
