"""Compact, portable storage for token ids and logprobs.

They are the bulk of every record and are always read whole, so they are stored as little-endian
int32 / float32 bytes (4 bytes a token) instead of JSON text (often 6-20 bytes a token).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

_SWAP = sys.byteorder != "little"


def encode_ids(ids: Sequence[int] | None) -> bytes | None:
    if ids is None:
        return None
    packed = array("i", ids)
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def decode_ids(blob: bytes | None) -> list[int] | None:
    if blob is None:
        return None
    packed = array("i")
    packed.frombytes(blob)
    if _SWAP:
        packed.byteswap()
    return packed.tolist()


def encode_logprobs(values: Sequence[float] | None) -> bytes | None:
    if values is None:
        return None
    packed = array("f", values)
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
