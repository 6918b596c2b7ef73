"""unsloth on CUDA: the same backend with unsloth's fused kernels and offloaded gradient checkpointing.

Everything but loading and the hidden-state forward is ``HFBackend``'s (the chunked logprobs, the
checkpoint format: a peft adapter vLLM loads), and the step is ``trainer.step``'s, so a run can move
between backends. unsloth is imported lazily and only here: it needs CUDA, and
installed outside a no-deps install it pulls a CUDA torch (docs/design.md §15), so it is an optional extra.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from trainer.backends.base import LoraSpec
from trainer.backends.hf import HFBackend
from trainer.lora import resolve_target_modules

if TYPE_CHECKING:
    from peft import PeftModel

INSTALL_HINT = "pip install 'trajgate[gpu]'"
# unsloth's causal-LM forward hands back the final hidden states in ``.logits`` instead of
# computing logits when this is "1" — the switch its own GRPO trainer uses for chunked logprobs.
_HIDDEN_STATES_ENV = "UNSLOTH_RETURN_HIDDEN_STATES"


def missing_requirements() -> list[str]:
    """What this machine lacks for the unsloth backend (empty when it can run)."""
    missing = []
    if not torch.cuda.is_available():
        missing.append("a CUDA GPU (torch.cuda.is_available() is False)")
    if importlib.util.find_spec("unsloth") is None:
        missing.append("the unsloth package")
    return missing


def require_unsloth() -> None:
    """One clear line instead of an ImportError or a CUDA error deep inside unsloth."""
    missing = missing_requirements()
    if missing:
        raise RuntimeError(
            f"the unsloth backend needs {' and '.join(missing)}; on a CUDA machine install it with "
            f"{INSTALL_HINT}, or use backend 'hf'"
        )


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            del os.environ[name]
        else:
            os.environ[name] = previous


class UnslothBackend(HFBackend):
    """``FastLanguageModel`` in bf16 (no 4-bit: vLLM serves the 16-bit base, and the importance
    ratio is only meaningful against the weights vLLM sampled from) with unsloth's LoRA.

    ``gradient_checkpointing`` defaults on here: unsloth's variant offloads activations to CPU
    memory asynchronously, its main memory saving at little cost. ``max_seq_length`` sizes unsloth's
    RoPE caches; rows must not be longer.
    """

    name = "unsloth"

    def __init__(
        self,
        base_weights: str,
        lora: LoraSpec,
        learning_rate: float,
        *,
        device: str | None = None,
        dtype: str | None = None,
        seed: int = 0,
        grad_clip: float = 1.0,
        weight_decay: float = 0.0,
        logprob_chunk: int = 1024,
        gradient_checkpointing: bool = True,
        logprob_dtype: str | None = "float32",
        max_seq_length: int = 4096,
    ) -> None:
        require_unsloth()
        if device is not None and torch.device(device).type != "cuda":
            raise RuntimeError(f"the unsloth backend runs on CUDA only, not {device!r}; use backend 'hf'")
        self.max_seq_length = max_seq_length
        super().__init__(
            base_weights,
            lora,
            learning_rate,
            device=device,
            dtype=dtype,
            seed=seed,
            grad_clip=grad_clip,
            weight_decay=weight_decay,
            logprob_chunk=logprob_chunk,
            gradient_checkpointing=gradient_checkpointing,
            logprob_dtype=logprob_dtype,
        )

    def _load_model(self) -> tuple[PeftModel, list[str]]:
        from unsloth import FastLanguageModel

        model, _tokenizer = FastLanguageModel.from_pretrained(
            model_name=self.base_weights,
            max_seq_length=self.max_seq_length,
            dtype=self.dtype,
            load_in_4bit=False,
            load_in_8bit=False,
            full_finetuning=False,
            local_files_only=True,
            random_state=self.seed,
        )
        targets = resolve_target_modules(model, self.lora.targets)
        model = FastLanguageModel.get_peft_model(
            model,
            r=self.lora.rank,
            lora_alpha=self.lora.alpha,
            target_modules=targets,
            lora_dropout=self.lora.dropout,
            bias="none",
            use_gradient_checkpointing="unsloth" if self.gradient_checkpointing else False,
            random_state=self.seed,
        )
        return model, targets

    def _final_hidden(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """unsloth's whole forward (its kernels live there) with the LM head skipped."""
        if input_ids.shape[1] > self.max_seq_length:
            raise ValueError(f"a row of {input_ids.shape[1]} tokens exceeds max_seq_length {self.max_seq_length}")
        with _env(_HIDDEN_STATES_ENV, "1"):
            out: Tensor = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        hidden_size = self._lm_head_weight.shape[1]
        if out.shape[-1] != hidden_size:
            raise RuntimeError(
                f"unsloth's forward for this model ignores {_HIDDEN_STATES_ENV} (got a last dimension of "
                f"{out.shape[-1]}, not the hidden size {hidden_size}): use backend 'hf'"
            )
        return out
