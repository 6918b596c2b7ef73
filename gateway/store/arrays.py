"""Compact, portable storage for token ids and logprobs.

They are the bulk of every record and are always read whole, so they are stored as little-endian
int32 / float32 bytes (4 bytes a token) instead of JSON text (often 6-20 bytes a token).
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence
from typing import NamedTuple

_SWAP = sys.byteorder != "little"


class PackedArrays(NamedTuple):
    """A record's token arrays as its row's columns hold them. Packed once, on the event loop for the record's
    write-ahead log line, and handed to the writer with the record, which would otherwise pack them again."""

    prompt: bytes | None
    completion: bytes | None
    logprobs: bytes | None


def pack_arrays(
    prompt: Sequence[int] | None, completion: Sequence[int] | None, logprobs: Sequence[float] | None
) -> PackedArrays:
    """Raises what `encode_ids` and `encode_logprobs` raise for values the columns cannot hold."""
    return PackedArrays(encode_ids(prompt), encode_ids(completion), encode_logprobs(logprobs))


def encode_ids(ids: Sequence[int] | None) -> bytes | None:
    return None if ids is None else _pack("i", ids)


def decode_ids(blob: bytes | None) -> list[int] | None:
    if blob is None:
        return None
    packed = array("i")
    packed.frombytes(blob)
    if _SWAP:
        packed.byteswap()
    return packed.tolist()


def encode_logprobs(values: Sequence[float] | None) -> bytes | None:
    return None if values is None else _pack("f", values)


def _pack(typecode: str, values: Sequence[int] | Sequence[float]) -> bytes:
    """Packed by `struct`, not `array`: 13-29 ns an id against 41-50 from 71 ids up (bench/README.md, "Packing token
    ids"), and every record's ids are packed on the event loop for its write-ahead log line (the writer stores those
    bytes), on a coding agent's every call a prompt of tens of thousands of ids. Whatever struct refuses (an id outside
    int32, a logprob past float32, not a number, not a sequence) goes through `array`, which packs or refuses it as it
    always has: a logprob past float32 as an infinity, a bad id with the OverflowError or TypeError the spool
    expects."""
    try:
        return struct.pack(f"<{len(values)}{typecode}", *values)
    except (struct.error, TypeError, OverflowError):
        packed = array(typecode, values)
        if _SWAP:
            packed.byteswap()
        return packed.tobytes()


def decode_logprobs(blob: bytes | None) -> list[float] | None:
    if blob is None:
        return None
    packed = array("f")
    packed.frombytes(blob)
    if _SWAP:
        packed.byteswap()
    return packed.tolist()
