"""Web UI sessions, in the database so that a login works on every gateway sharing it and a logout ends it on all.

The cookie is a random id (256 bits) and only its SHA-256 is stored: reading the table gives no usable cookie. A
session is valid until it expires (TRAJGATE_UI_SESSION_S), is revoked by logging out, or the admin key changes: each
row holds a fingerprint of the admin key it was made with, compared with the current one on every check.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import UTC, datetime, timedelta

from sqlalchemy import Engine, delete, insert, select, update

from gateway.store.models import UiSession


def _hash(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


def create_session(engine: Engine, admin_key_hash: str, lifetime_s: float) -> str:
    """A new session's id (the cookie's value); sessions expired by now are deleted on the way."""
    session_id = secrets.token_urlsafe(32)
    now = datetime.now(UTC)
    with engine.begin() as conn:
        conn.execute(delete(UiSession).where(UiSession.expires_at < now))
        conn.execute(
            insert(UiSession).values(
                id_hash=_hash(session_id),
                admin_key_hash=admin_key_hash,
                created_at=now,
                expires_at=now + timedelta(seconds=lifetime_s),
            )
        )
    return session_id


def session_valid(engine: Engine, session_id: str, admin_key_hash: str) -> bool:
    """Whether the session exists, has neither expired nor been revoked, and was made with the current admin key."""
    with engine.connect() as conn:
        row = conn.execute(
            select(UiSession.id_hash).where(
                UiSession.id_hash == _hash(session_id),
                UiSession.admin_key_hash == admin_key_hash,
                UiSession.revoked_at.is_(None),
                UiSession.expires_at > datetime.now(UTC),
            )
        ).first()
    return row is not None


def revoke_session(engine: Engine, session_id: str) -> None:
    """End the session (logout), wherever its cookie is presented from now on."""
    with engine.begin() as conn:
        conn.execute(
            update(UiSession)
            .where(UiSession.id_hash == _hash(session_id), UiSession.revoked_at.is_(None))
            .values(revoked_at=datetime.now(UTC))
        )
