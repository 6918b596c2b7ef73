"""Linear storage of chat requests: a call stores only the request messages past those it shares with its
predecessor's request (the same predecessor as the token lineage, gateway.store.lineage).

An agent resends its whole history every turn, so whole requests make a trajectory's stored bytes grow with the square
of its turns. Messages are shared only when they are equal as JSON, types and all (`1` is not `1.0` nor `true`, which
Python's `==` would let through), so putting the parent's messages back gives exactly what storing the whole request
would have read back. Equality is judged on digests of each message's serialised form, which is what the lineage
cache keeps (16 bytes a message instead of the messages). Key order counts where the database keeps it (SQLite stores
the JSON text); Postgres' JSONB reorders keys anyway, so there keys are compared sorted and a message read back from
the database still matches the same message as the client sent it.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

DIGEST_BYTES = 16


def keeps_key_order(dialect: str) -> bool:
    """Whether the dialect's JSON column reads keys back in the order they were written."""
    return dialect != "postgresql"


def message_digests(request: dict[str, Any] | None, ordered: bool) -> bytes | None:
    """One digest per request message, concatenated; None if the request has no message list or a message cannot be
    serialised (it is then stored whole, as before)."""
    messages = (request or {}).get("messages")
    if not isinstance(messages, list):
        return None
    option = orjson.OPT_NON_STR_KEYS if ordered else orjson.OPT_NON_STR_KEYS | orjson.OPT_SORT_KEYS
    try:
        return b"".join(
            hashlib.blake2b(orjson.dumps(message, option=option), digest_size=DIGEST_BYTES).digest()
            for message in messages
        )
    except (TypeError, orjson.JSONEncodeError):
        return None


def first_message(digests: bytes | None) -> bytes | None:
    """The first message's digest out of a request's message digests; None when it has no message."""
    return digests[:DIGEST_BYTES] if digests else None


def first_message_digest(request: dict[str, Any] | None, ordered: bool) -> bytes | None:
    """The first message's digest of a request, as message_digests gives it, without hashing the other messages."""
    messages = (request or {}).get("messages")
    if not isinstance(messages, list):
        return None
    return first_message(message_digests({"messages": messages[:1]}, ordered))


def shared_messages(own: bytes | None, parent: bytes | None) -> int:
    """How many leading messages the call shares with its parent's request."""
    if own is None or parent is None:
        return 0
    count = min(len(own), len(parent)) // DIGEST_BYTES
    for i in range(count):
        at = i * DIGEST_BYTES
        if own[at : at + DIGEST_BYTES] != parent[at : at + DIGEST_BYTES]:
            return i
    return count


def compact_request(request: dict[str, Any] | None, shared: int) -> dict[str, Any] | None:
    """The request as stored: its messages past the `shared` leading ones, every other key as sent, in its place."""
    if request is None or not shared:
        return request
    return {**request, "messages": request["messages"][shared:]}
