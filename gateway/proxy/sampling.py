"""Which sampling parameters a call is sent upstream with, and whether the trainer can learn from what came back.

vLLM reports raw logprobs (before temperature, top-p/top-k/min-p and penalties) and the trainer computes the
model's plain distribution the same way. A call sampled any other way was drawn from a different policy than the
one both sides score, and the importance ratio still reads about 1: nothing would show the mismatch. So in train
mode the gateway sends the neutral values explicitly (an absent one would get the model's generation_config
defaults in vLLM, which need not be neutral), and a call that was sampled otherwise, because the run pins a value
or turned `on_policy_sampling` off, is recorded untrainable with the parameters named. Eval traffic measures the
agent as deployed: it keeps the client's values.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

# The values under which vLLM samples from exactly the distribution its raw logprobs describe.
NEUTRAL: dict[str, float | int] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}
# vLLM reads top_k 0 and -1 alike: no top-k filter.
_ALSO_NEUTRAL: dict[str, tuple[float | int, ...]] = {"top_k": (0,)}


@dataclass(frozen=True, slots=True)
class SamplingPlan:
    """`upstream`: keys to set in the upstream body (they replace the client's). `off_policy`: why the trainer must
    not learn from the call, or None."""

    upstream: Mapping[str, Any]  # shared between calls: read, never changed
    off_policy: str | None


def plan(request: dict[str, Any], mode: str, overrides: dict[str, Any], on_policy: bool) -> SamplingPlan:
    """The run's explicit overrides always win; in train mode the other sampling keys are the neutral values
    (`on_policy`) or the client's, with any the client left out set neutral so vLLM's model defaults can't apply."""
    if mode != "train":
        return SamplingPlan(dict(overrides), None)
    if on_policy:
        try:
            return _on_policy_plan(tuple(overrides.items()))
        except TypeError:  # an unhashable override value (a list): worked out afresh
            base = dict(NEUTRAL)
    else:
        base = {key: request[key] if request.get(key) is not None else value for key, value in NEUTRAL.items()}
    upstream = {**base, **overrides}
    return SamplingPlan(upstream, off_policy_reason(upstream))


@functools.lru_cache(maxsize=1024)
def _on_policy_plan(overrides: tuple[tuple[str, Any], ...]) -> SamplingPlan:
    """The plan of every on-policy train call of a run, which depends on the run's overrides alone: worked out once
    per set of overrides rather than per call (the sampling keys' checks were a few percent of the hot path)."""
    upstream = {**NEUTRAL, **dict(overrides)}
    return SamplingPlan(MappingProxyType(upstream), off_policy_reason(upstream))


def off_policy_reason(values: dict[str, Any]) -> str | None:
    """Names every sampling parameter in `values` that moves the sampled distribution away from the raw model's."""
    changed = [f"{key}={values[key]!r}" for key in NEUTRAL if key in values and not _is_neutral(key, values[key])]
    if not changed:
        return None
    return (
        f"sampled with {', '.join(changed)}: vLLM's logprobs and the trainer's are of the untempered, unfiltered "
        "model, not of the distribution this call was drawn from"
    )


def _is_neutral(key: str, value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return False
    return value == NEUTRAL[key] or value in _ALSO_NEUTRAL.get(key, ())
