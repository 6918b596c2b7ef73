"""vLLM's adapter slots, counted in the database: every policy_versions row not yet unloaded holds one.

vLLM keeps at most `--max-loras` adapters (TRAJGATE_VLLM_MAX_LORAS) where requests can use them; loading one more
pushes the least recently used one out (docs/design.md, "LoRA"). Several trainer processes may share one vLLM, so
no process can count from what it loaded itself: the count is the rows of all runs in `loading` (a slot claimed, the
adapter being loaded and checked, not routed to yet), `loaded` and `retiring` (no longer routed to, still in vLLM).

A trainer claims a slot before it loads an adapter (`claim_slot`), in a transaction that counts and inserts under
one lock (a Postgres advisory lock; SQLite's BEGIN IMMEDIATE takes its one write lock), so two trainers cannot both
take the last slot. Publishing turns the claim into the served version (gateway/store/training.py
`publish_version`); a failed load gives the slot back (`release_slot`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from sqlalchemy import Connection, Engine, Table, delete, func, select

from gateway.store.db import write_transaction
from gateway.store.models import PolicyVersion, utcnow

# Statuses whose adapter is (or is about to be) in vLLM.
HELD = ("loading", "loaded", "retiring")
# Any constant both trainers agree on: the key of the Postgres advisory lock that serialises slot claims.
_SLOT_LOCK = 0x7472616A  # "traj"


@dataclass(frozen=True)
class SlotClaim:
    """The answer to a claim: `claimed` (the slot is this version's), else the slots in use against the cap."""

    claimed: bool
    used: int
    total: int | None


def adapters_held(conn: Connection | Engine) -> dict[str, list[str]]:
    """Run -> the served names it holds in vLLM (loading, loaded or retiring), oldest first."""
    query = (
        select(PolicyVersion.run, PolicyVersion.served_name)
        .where(PolicyVersion.status.in_(HELD), PolicyVersion.step > 0)
        .order_by(PolicyVersion.run, PolicyVersion.step)
    )
    if isinstance(conn, Engine):
        with conn.connect() as connection:
            rows = connection.execute(query).all()
    else:
        rows = conn.execute(query).all()
    held: dict[str, list[str]] = {}
    for row in rows:
        held.setdefault(row.run, []).append(row.served_name)
    return held


def _lock(conn: Connection) -> None:
    if conn.dialect.name == "postgresql":
        conn.execute(select(func.pg_advisory_xact_lock(_SLOT_LOCK)))


def claim_slot(
    engine: Engine, run: str, step: int, served_name: str, adapter_path: str, max_loras: int | None
) -> SlotClaim:
    """Take a slot for `run@step` (a `loading` row) if fewer than `max_loras` are held, all runs together; None
    means the cap is unknown and the slot is always taken. A claim the version already holds (a retry after a
    failed load whose unload was refused, or a restart) is kept."""
    with write_transaction(engine) as conn:
        _lock(conn)
        status = conn.execute(
            select(PolicyVersion.status).where(PolicyVersion.run == run, PolicyVersion.step == step)
        ).scalar_one_or_none()
        held = PolicyVersion.status.in_(HELD), PolicyVersion.step > 0
        used = conn.execute(select(func.count()).select_from(PolicyVersion).where(*held)).scalar_one()
        if status in HELD:
            return SlotClaim(True, used, max_loras)
        if max_loras is not None and used + 1 > max_loras:
            return SlotClaim(False, used, max_loras)
        if status is not None:  # unloaded long ago (a database reset to an older step): serve it again
            conn.execute(delete(PolicyVersion).where(PolicyVersion.run == run, PolicyVersion.step == step))
        conn.execute(
            cast(Table, PolicyVersion.__table__).insert().values(
                run=run, step=step, served_name=served_name, adapter_path=adapter_path, status="loading",
                created_at=utcnow(),
            )
        )
        return SlotClaim(True, used + 1, max_loras)


def release_slot(engine: Engine, run: str, step: int) -> None:
    """Give back the slot of a version that was never published (its load failed and vLLM no longer holds it)."""
    with engine.begin() as conn:
        conn.execute(
            delete(PolicyVersion).where(
                PolicyVersion.run == run, PolicyVersion.step == step, PolicyVersion.status == "loading"
            )
        )


def pending_claims(engine: Engine, run: str) -> list[tuple[int, str]]:
    """The run's claimed but unpublished versions (step, served name): a load that failed and could not be undone,
    or one a crashed trainer left."""
    with engine.connect() as conn:
        rows = conn.execute(
            select(PolicyVersion.step, PolicyVersion.served_name)
            .where(PolicyVersion.run == run, PolicyVersion.status == "loading")
            .order_by(PolicyVersion.step)
        ).all()
    return [(row.step, row.served_name) for row in rows]


def retiring_count(engine: Engine) -> int:
    """Retired versions (every run's) still in vLLM: the slots that free up once gateways stop routing to them."""
    with engine.connect() as conn:
        query = select(func.count()).select_from(PolicyVersion).where(PolicyVersion.status == "retiring")
        return int(conn.execute(query).scalar_one())
