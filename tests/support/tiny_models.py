"""A tiny random Llama built on the spot (CPU, fp32, no downloads), the hf backend on it, and rows of token ids for it:
what the backend, checkpoint, distributed, trainer-loop and SFT tests train, and the torchrun e2e runs."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from trainer.backends import HFBackend, LoraSpec
from trainer.samples import Row

VOCAB = 512
HIDDEN = 64
FFN = 128
LAYERS = 2
PATTERN = 7  # the token the rewarded completions repeat


def build_tiny_llama(directory: Path) -> Path:
    """Seeded random Llama: vocab 512, hidden 64, 2 layers, 2 heads (head_dim 32, as vLLM CPU needs)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        # With the default 0.02 the frozen, tied LM head caps any logit near 8·0.16 ≈ 1.3 (RMSNorm
        # fixes |h| ≈ √64), so no adapter could make a token likely: too flat to show learning.
        initializer_range=0.1,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def make(tiny: str, lr: float = 1e-2, lora: LoraSpec | None = None, **options: Any) -> HFBackend:
    return HFBackend(tiny, lora or LoraSpec(), lr, device="cpu", **options)


def row(prompt: list[int], completion: list[int], advantage: float, sequence_id: int) -> Row:
    ids = prompt + completion
    return Row(
        input_ids=ids,
        loss_mask=[0] * len(prompt) + [1] * len(completion),
        behaviour_logprobs=[0.0] * len(ids),
        advantage=advantage,
        trajectory_id=f"t{sequence_id}",
        group_id="g",
        sequence_id=sequence_id,
    )


def mixed_rows(seed: int = 0, n: int = 6) -> list[Row]:
    """Rows of different lengths (so micro-batches pad) with random ids and mixed advantages."""
    rng = random.Random(seed)
    return [
        row(
            [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))],
            [rng.randrange(VOCAB) for _ in range(rng.randint(2, 8))],
            advantage=rng.choice([-1.0, -0.5, 0.5, 1.0]),
            sequence_id=i,
        )
        for i in range(n)
    ]


def set_behaviour(backend: HFBackend, rows: list[Row]) -> list[Row]:
    """Behaviour logprobs = the backend's own (what vLLM would report for the same weights)."""
    for r, lps in zip(rows, backend.token_logprobs(rows), strict=True):
        r.behaviour_logprobs = [lp if m else 0.0 for lp, m in zip(lps, r.loss_mask, strict=True)]
    return rows
