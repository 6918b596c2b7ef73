"""A record as one line of the spool (the writer's write-ahead log), and how a failed write is classified.

Shared by the spool (gateway.recorder.spool, which reads lines back on replay), the writer thread
(gateway.recorder.writer) and the writer process (gateway.recorder.writer_process); the last two also sort failures
into "this record can never be stored" and "the database is away". Kept apart from all three so that none imports
another's module for it.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import orjson
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, SQLAlchemyError, StatementError

from gateway.store.arrays import PackedArrays, decode_ids, decode_logprobs, encode_ids, encode_logprobs, pack_arrays
from gateway.store.call_record import CallRecord

_FIELDS = tuple(f.name for f in fields(CallRecord))


class WriteFailed(Exception):
    """A batch the writer process could not store: `record` says whether a record's data is the cause (retrying it
    can never succeed) or the database or the process (retrying later will)."""

    def __init__(self, reason: str, record: bool) -> None:
        super().__init__(reason)
        self.record = record


# Token arrays travel as base64 of the store's packed bytes: JSON (orjson) turns a -inf logprob into null, and
# parsing thousands of JSON numbers per record made replay the bottleneck of catching up after an outage. In
# PackedArrays' order: spool_line and read_spool_record pair these names with its fields by position.
_PACKED: dict[str, tuple[Callable[[Any], bytes | None], Callable[[bytes], list[Any] | None]]] = {
    "prompt_token_ids": (encode_ids, decode_ids),
    "completion_token_ids": (encode_ids, decode_ids),
    "completion_logprobs": (encode_logprobs, decode_logprobs),
}


def packed_arrays(record: CallRecord) -> PackedArrays | None:
    """The record's arrays packed for its line and its row at once; None if the columns cannot hold one of them."""
    try:
        return pack_arrays(record.prompt_token_ids, record.completion_token_ids, record.completion_logprobs)
    except (TypeError, OverflowError):
        return None


def spool_line(record: CallRecord, packed: PackedArrays | None = None) -> bytes:
    """One JSONL line, lossless for every field the database stores. Every record passes here on the response path,
    so the common case (string keys only, as JSON parsing gives) skips orjson's slower non-string-key mode.
    `packed`: the record's arrays as `packed_arrays` gave them, where the caller has them."""
    data = {name: getattr(record, name) for name in _FIELDS}
    if packed is not None:
        for name, value in zip(_PACKED, packed, strict=True):
            if value is not None:
                data[name] = base64.b64encode(value).decode()
    else:
        for name, (encode, _) in _PACKED.items():
            try:
                value = encode(data[name])
            except (TypeError, OverflowError):
                continue  # unpackable values stay JSON, to be refused by the store and kept in rejected/
            if value is not None:
                data[name] = base64.b64encode(value).decode()
    try:
        return orjson.dumps(data, option=orjson.OPT_APPEND_NEWLINE)
    except TypeError:
        return orjson.dumps(data, option=orjson.OPT_APPEND_NEWLINE | orjson.OPT_NON_STR_KEYS)


def read_spool_line(line: bytes) -> CallRecord:
    """Inverse of `spool_line`; raises ValueError for a line that is not a whole record (a torn append)."""
    return read_spool_record(line)[0]


def read_spool_record(line: bytes) -> tuple[CallRecord, PackedArrays | None]:
    """`read_spool_line`, and the record's arrays as the line packed them (None if one of them stayed JSON): the bytes
    its row stores, which the writer need not pack again from the lists."""
    data = orjson.loads(line)  # a torn line is truncated JSON, so it fails here
    if not isinstance(data, dict):
        raise ValueError("not a record")
    packed: list[bytes | None] = []
    for name, (_, decode) in _PACKED.items():
        value = data.get(name)
        if isinstance(value, str):
            blob = base64.b64decode(value)
            data[name] = decode(blob)
            packed.append(blob)
        elif value is None:
            packed.append(None)
    # By position, not `CallRecord(**data)`: the keys orjson makes are not the interned strings of the parameters'
    # names, and CPython then matches each keyword by comparing it with every name (a read-back cost ~10 µs more on
    # a 2-core Intel Xeon, bench/README.md). Fields added to CallRecord after a line was spooled read as None, so an
    # upgrade can replay an older spool.
    values: list[Any] = [data.get(name) for name in _FIELDS]
    return CallRecord(*values), PackedArrays(*packed) if len(packed) == len(_PACKED) else None


def reason(exc: BaseException) -> str:
    """The driver's first line only: SQLAlchemy's message carries the SQL and its parameters (whole records)."""
    text = str(getattr(exc, "orig", None) or exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def is_record_error(exc: BaseException) -> bool:
    """Whether the failure is about the data of some record (retrying it can never succeed) rather than the
    database being unavailable (retrying later will). Unknown database errors count as unavailability, so a
    misconfigured or read-only database spools records instead of rejecting them."""
    if isinstance(exc, WriteFailed):
        return exc.record
    if isinstance(exc, (IntegrityError, DataError)):
        return True
    if isinstance(exc, DBAPIError):
        return False
    if isinstance(exc, StatementError):
        return True  # raised while binding parameters, e.g. JSON that cannot be serialized
    return not isinstance(exc, SQLAlchemyError)  # e.g. a token id that does not fit int32
