"""LoRA adapters as vLLM will load them: allowed ranks, concrete target modules, a saved-adapter check.

The trainer publishes every step's adapter to vLLM (``POST /v1/load_lora_adapter``). vLLM reads
``adapter_config.json`` + ``adapter_model.safetensors`` and refuses features it does not implement
(DoRA, LoRA bias, ``modules_to_save``, exotic inits, a rank above ``--max-lora-rank``). Finding that
out when vLLM answers 400 means a trained step that can never be served, so the trainer checks the
files it wrote against the same rules first.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

# The ranks vLLM's --max-lora-rank accepts (docs/design.md §4).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
ALL_LINEAR = "all-linear"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def resolve_target_modules(model: nn.Module, targets: str | Sequence[str]) -> list[str]:
    """The concrete module names (last name component, e.g. ``q_proj``) LoRA attaches to.

    ``"all-linear"`` means every ``nn.Linear`` except the output embedding (the LM head), as in
    peft. It is resolved here rather than handed to peft because peft would write either the
    shorthand or full per-layer paths into ``adapter_config.json``; short names are what vLLM and
    every other consumer expect, and unsloth's ``get_peft_model`` wants a list anyway. A given list
    must name existing linear modules: a typo would otherwise train an adapter on nothing.
    """
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    output = get_output_embeddings() if callable(get_output_embeddings) else None
    linear = set()
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or module is output:
            continue
        parts = name.split(".")
        # A model that already carries an adapter (several runs on one base): peft wraps each target as
        # `q_proj.base_layer` beside `q_proj.lora_A.<adapter>`; the target is `q_proj`, the LoRA matrices are none.
        if any(part.startswith("lora_") for part in parts):
            continue
        linear.add(parts[parts.index("base_layer") - 1] if "base_layer" in parts else parts[-1])
    if targets == ALL_LINEAR:
        if not linear:
            raise ValueError("the model has no linear layers to attach LoRA to")
        return sorted(linear)
    unknown = sorted(set(targets) - linear)
    if unknown:
        raise ValueError(f"LoRA targets {unknown} are not linear modules of the model (it has {sorted(linear)})")
    return sorted(set(targets))


def check_vllm_adapter(directory: Path, max_lora_rank: int | None = None) -> dict[str, Any]:
    """Raise ``ValueError`` naming every reason vLLM would refuse the adapter in ``directory``.

    Returns the parsed ``adapter_config.json``. Mirrors vLLM's ``PEFTHelper`` validation (0.32):
    plain LoRA only, ``bias == "none"``, no ``modules_to_save``, a rank vLLM allows (and at most
    ``max_lora_rank`` when given), plus what our own publishing relies on: concrete
    ``target_modules`` names and safetensors weights.
    """
    config_path = directory / ADAPTER_CONFIG
    if not config_path.is_file():
        raise ValueError(f"{directory} has no {ADAPTER_CONFIG}")
    config: dict[str, Any] = json.loads(config_path.read_text())
    problems: list[str] = []
    if not (directory / ADAPTER_WEIGHTS).is_file():
        problems.append(f"no {ADAPTER_WEIGHTS}")
    if config.get("peft_type") != "LORA":
        problems.append(f"peft_type is {config.get('peft_type')!r}, not 'LORA'")
    rank = config.get("r")
    ranks = [rank, *(config.get("rank_pattern") or {}).values()]
    if any(r not in VLLM_LORA_RANKS for r in ranks):
        problems.append(f"rank(s) {ranks} not all in vLLM's allowed {VLLM_LORA_RANKS}")
    if max_lora_rank is not None and any(isinstance(r, int) and r > max_lora_rank for r in ranks):
        problems.append(f"rank {max(r for r in ranks if isinstance(r, int))} > vLLM's --max-lora-rank {max_lora_rank}")
    targets = config.get("target_modules")
    if not isinstance(targets, list) or not targets or ALL_LINEAR in targets:
        problems.append(f"target_modules must list concrete module names, got {targets!r}")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        problems.append("adapter bias is not supported by vLLM")
    if config.get("modules_to_save"):
        problems.append(f"modules_to_save {config['modules_to_save']} is not supported by vLLM")
    if config.get("use_dora"):
        problems.append("DoRA is not supported by vLLM")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in ("gaussian", "eva", "orthogonal", "mica", "lora_ga"):
        problems.append(f"init_lora_weights={init!r} modifies the base weights; vLLM refuses it")
    if problems:
        raise ValueError(f"adapter in {directory} would be refused by vLLM: " + "; ".join(problems))
    return config
