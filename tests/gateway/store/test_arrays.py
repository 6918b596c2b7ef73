"""Token ids and logprobs survive storage exactly, as bytes, on both backends."""

from __future__ import annotations

import math
import random
import struct

import pytest
from sqlalchemy import insert, select

from gateway.store import db
from gateway.store.arrays import decode_ids, decode_logprobs, encode_ids, encode_logprobs
from gateway.store.models import Call, Group, Run, Trajectory


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _sample(n: int, seed: int) -> tuple[list[int], list[float]]:
    rng = random.Random(seed)
    ids = [rng.randrange(0, 2**31 - 1) for _ in range(n)] + [0, 1, 49151, 2**31 - 1]
    # vLLM computes logprobs in float32, so real values are exactly float32-representable.
    logprobs = [_f32(-rng.expovariate(1.0)) for _ in range(n)] + [0.0, -0.0, _f32(-1e-8), -math.inf]
    return ids, logprobs


def test_encoding_is_little_endian_and_compact() -> None:
    assert encode_ids([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    assert encode_logprobs([-1.0]) == struct.pack("<f", -1.0)
    assert len(encode_ids(list(range(1000))) or b"") == 4000
    assert encode_ids(None) is None and decode_ids(None) is None
    assert decode_ids(encode_ids([])) == []


def test_ids_are_packed_as_int32_whatever_holds_them_and_refused_as_the_spool_expects() -> None:
    # The write-ahead log keeps a record whose ids cannot be packed as JSON and lets the store refuse it
    # (gateway.recorder.spool_lines catches exactly TypeError and OverflowError), so those are the errors.
    extremes = [-(2**31), 2**31 - 1, -1]
    for ids, values in ((extremes, extremes), ([True, False], [1, 0]), (range(3), [0, 1, 2]), (iter([5, 6]), [5, 6])):
        assert encode_ids(ids) == struct.pack(f"<{len(values)}i", *values)  # type: ignore[arg-type]
    for too_big in ([2**31], [-(2**31) - 1], [1, 2**40]):
        with pytest.raises(OverflowError):
            encode_ids(too_big)
    for not_ids in ([1.0], ["1"], [None], [[1]], 5):
        with pytest.raises(TypeError):
            encode_ids(not_ids)  # type: ignore[arg-type]
    # A logprob past float32 packs as an infinity, as it always has; integers are numbers.
    assert decode_logprobs(encode_logprobs([-1e39, 1e39, 0, -1])) == [-math.inf, math.inf, 0.0, -1.0]
    with pytest.raises(TypeError):
        encode_logprobs(["-1.0"])  # type: ignore[list-item]


def test_roundtrip_in_memory() -> None:
    ids, logprobs = _sample(5000, seed=1)
    assert decode_ids(encode_ids(ids)) == ids
    assert decode_logprobs(encode_logprobs(logprobs)) == logprobs


def test_roundtrip_through_database(db_url: str) -> None:
    db.upgrade(db_url)
    engine = db.make_engine(db_url)
    ids, logprobs = _sample(2048, seed=2)
    try:
        with engine.begin() as conn:
            conn.execute(insert(Run).values(name="r", base_model="base", config={}))
            conn.execute(insert(Group).values(group_id="g", run="r"))
            conn.execute(insert(Trajectory).values(trajectory_id="t", run="r", group_id="g"))
            conn.execute(
                insert(Call).values(
                    id="c1",
                    trajectory_id="t",
                    seq=1,
                    run="r",
                    endpoint="chat",
                    prompt_token_ids=encode_ids(ids),
                    completion_token_ids=encode_ids(ids[:7]),
                    completion_logprobs=encode_logprobs(logprobs),
                )
            )
        with engine.connect() as conn:
            row = conn.execute(
                select(Call.prompt_token_ids, Call.completion_token_ids, Call.completion_logprobs)
            ).one()
    finally:
        engine.dispose()
    assert decode_ids(row.prompt_token_ids) == ids
    assert decode_ids(row.completion_token_ids) == ids[:7]
    assert decode_logprobs(row.completion_logprobs) == logprobs
