"""Training backends behind one interface (``TrainerBackend``): ``hf`` everywhere, ``unsloth`` on CUDA.

Importing this package imports torch but neither transformers, peft nor unsloth: those load when a
backend is built (for the unsloth backend, unsloth before the others, so that its patches apply).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from trainer.backends.base import LoraSpec, TrainerBackend
from trainer.backends.hf import HFBackend
from trainer.backends.unsloth import UnslothBackend, missing_requirements

BackendName = Literal["auto", "hf", "unsloth"]

__all__ = [
    "BackendName",
    "HFBackend",
    "LoraSpec",
    "TrainerBackend",
    "UnslothBackend",
    "make_backend",
    "resolve_backend_name",
]


def resolve_backend_name(name: BackendName, device: str | None = None) -> Literal["hf", "unsloth"]:
    """``auto`` → unsloth when CUDA and the package are both there (and no non-CUDA ``device`` was
    asked for), else hf (docs/design.md §12)."""
    if name == "auto":
        on_cuda = device is None or torch.device(device).type == "cuda"
        return "unsloth" if on_cuda and not missing_requirements() else "hf"
    if name not in ("hf", "unsloth"):
        raise ValueError(f"unknown backend {name!r} (expected auto, hf or unsloth)")
    return name


def make_backend(
    name: BackendName, base_weights: str, lora: LoraSpec, learning_rate: float, **options: Any
) -> TrainerBackend:
    """Build the named backend; ``options`` are the backend's keyword arguments (device, dtype,
    seed, grad_clip, weight_decay, logprob_chunk, gradient_checkpointing, …).

    ``unsloth`` on a machine without CUDA or without the package raises a one-line RuntimeError
    saying what is missing and how to install it.
    """
    backend = UnslothBackend if resolve_backend_name(name, options.get("device")) == "unsloth" else HFBackend
    return backend(base_weights, lora, learning_rate, **options)
