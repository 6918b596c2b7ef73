"""Models with random weights in the shapes of real ones, for the trainer benchmarks (bench/trainer_step.py,
bench/gpu_check.py).

A step costs the same whatever the weights are, and random ones need no download: the GPU machine gpu_check runs on
reaches nothing beyond the repo checkout and a few wheels (docs/gpu.md). Only torch is imported here; transformers
and tokenizers are imported when a model is built, because gpu_check's unsloth stage must import unsloth before
transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# What every Qwen2.5 / Qwen3 size below shares in its public config.
_QWEN: dict[str, Any] = dict(
    vocab_size=151936,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    tie_word_embeddings=True,
)
# The public configs of the measured models, keyed by a short name; `model_type` picks the transformers architecture.
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        model_type="llama",
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        tie_word_embeddings=True,
    ),
    "qwen2.5-0.5b": dict(
        _QWEN,
        model_type="qwen2",
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        max_position_embeddings=32768,
    ),
    "qwen2.5-1.5b": dict(
        _QWEN,
        model_type="qwen2",
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        max_position_embeddings=32768,
    ),
    "qwen3-4b": dict(
        _QWEN,
        model_type="qwen3",
        hidden_size=2560,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=9728,
        max_position_embeddings=40960,
        attention_bias=False,
    ),
}
# Both Qwen architectures at toy size: every stage of gpu_check in seconds on a CPU.
_TINY: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=2048,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
)
TINY_SHAPES: dict[str, dict[str, Any]] = {
    "tiny-qwen2": dict(model_type="qwen2", **_TINY),
    "tiny-qwen3": dict(model_type="qwen3", head_dim=16, **_TINY),
}


def shape_spec(name: str, layers: int | None = None) -> dict[str, Any]:
    """The config of shape `name` (SHAPES or TINY_SHAPES), cut to `layers` decoder layers if given."""
    spec = dict({**SHAPES, **TINY_SHAPES}[name])
    if layers is not None:
        spec["num_hidden_layers"] = layers
    return spec


def build_random_model(
    spec: dict[str, Any], directory: Path, device: torch.device, dtype: torch.dtype, tokenizer: bool
) -> int:
    """Random weights of `spec`'s shape (seeded: the same every run), saved to `directory` in `dtype`, plus a
    placeholder tokenizer if asked (unsloth's loader wants one). Built on `device`: initialising 4B parameters there
    takes a second, on a CPU a minute. Returns the parameter count."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(spec)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    model.to(dtype).save_pretrained(directory)  # type: ignore[arg-type]  # transformers' typing of .to is wrong
    if tokenizer:
        write_placeholder_tokenizer(directory, config.vocab_size)
    return params


def write_placeholder_tokenizer(directory: Path, vocab_size: int) -> None:
    """unsloth's loader also loads a tokenizer; a random-weights model has none. A word-level one
    over placeholder tokens is enough: the benchmarks feed token ids."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<t{i}>": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<t0>"))
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<t0>", pad_token="<t0>", eos_token="<t1>"
    ).save_pretrained(directory)
