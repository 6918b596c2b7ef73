"""CallRecords shaped like what the gateway captures, for store and writer tests."""

from __future__ import annotations

import math
import random
import struct
import time
import uuid
from typing import Any

from gateway.store.call_record import CallRecord


def f32(x: float) -> float:
    """vLLM computes logprobs in float32, so real values are exactly float32-representable."""
    value: float = struct.unpack("<f", struct.pack("<f", x))[0]
    return value


def make_record(
    trajectory_id: str = "traj-1",
    seq: int = 0,
    *,
    prompt_tokens: int = 8,
    completion_tokens: int = 4,
    seed: int | None = None,
    **overrides: Any,
) -> CallRecord:
    rng = random.Random(seed)
    logprobs = [f32(-rng.expovariate(1.0)) for _ in range(completion_tokens)]
    if logprobs:
        logprobs[0] = -math.inf  # vLLM reports -inf for tokens it forced; the store and the spool must keep it
    fields: dict[str, Any] = {
        "id": uuid.uuid4().hex,
        "run": "run-a",
        "base_model": "base-model",
        "trajectory_id": trajectory_id,
        "group_id": "group-1",
        "group_size": None,
        "mode": "train",
        "seq": seq,
        "choice_index": 0,
        "policy_version": 0,
        "endpoint": "chat",
        "stream": False,
        "request": {"model": "run-a", "messages": [{"role": "user", "content": "hi"}]},
        "response": {"choices": [{"message": {"role": "assistant", "content": "hello"}}]},
        "prompt_token_ids": [rng.randrange(0, 2**31 - 1) for _ in range(prompt_tokens)],
        "completion_token_ids": [rng.randrange(0, 50_000) for _ in range(completion_tokens)],
        "completion_logprobs": logprobs,
        "finish_reason": "stop",
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens},
        "status_code": 200,
        "error": None,
        "trainable": True,
        "untrainable_reason": None,
        "latency_ms": 12.5,
        "ttft_ms": None,
        "retry_count": 0,
        "idempotency_key": None,
        "created_at": time.time(),
    }
    fields.update(overrides)
    return CallRecord(**fields)
