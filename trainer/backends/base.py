"""The interface the training loop drives, independent of how the model was loaded.

A backend owns the policy (base weights + a LoRA adapter) and its optimizer. It loads the model,
computes the per-token logprobs of a batch, and saves and restores the adapter with everything
needed to continue exactly (optimizer moments, RNG states, the step count). The step itself —
micro-batching, the objective, backward, clipping, AdamW — is ``trainer.step``, shared by every
backend; so is the objective (``trainer.loss``, pure tensors).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from trainer.lora import ALL_LINEAR, VLLM_LORA_RANKS
from trainer.loss import LossConfig
from trainer.samples import Row, collate, micro_batches
from trainer.step import Collective, Progress, train_step

__all__ = ["LoraSpec", "Progress", "TrainerBackend", "resolve_device", "resolve_dtype"]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass(frozen=True)
class LoraSpec:
    """The adapter's shape (docs/objectives.md §6 defaults: r 16, α 32, all linear projections, no dropout).

    ``rank`` must be one vLLM accepts, or the trained adapter could never be served. ``targets`` is
    ``"all-linear"`` or module names (``["q_proj", "v_proj"]``); it is resolved to concrete names
    against the model when the adapter is created (``trainer.lora.resolve_target_modules``).
    """

    rank: int = 16
    alpha: int = 32
    targets: str | Sequence[str] = ALL_LINEAR
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.rank not in VLLM_LORA_RANKS:
            raise ValueError(f"LoRA rank {self.rank} is not one vLLM allows: {VLLM_LORA_RANKS}")
        if self.alpha <= 0:
            raise ValueError("LoRA alpha must be positive")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError("LoRA dropout must be in [0, 1)")
        if isinstance(self.targets, str):
            if self.targets != ALL_LINEAR:
                raise ValueError(f"LoRA targets must be {ALL_LINEAR!r} or a list of module names, got {self.targets!r}")
        else:
            # A tuple keeps the frozen spec hashable and comparable with one read back from JSON.
            names = tuple(self.targets)
            if not names or not all(isinstance(n, str) and n for n in names):
                raise ValueError("LoRA targets must be a non-empty list of module names")
            object.__setattr__(self, "targets", names)

    def to_json(self) -> dict[str, Any]:
        spec = asdict(self)
        spec["targets"] = self.targets if isinstance(self.targets, str) else list(self.targets)
        return spec

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LoraSpec:
        return cls(**data)


def resolve_device(device: str | None) -> torch.device:
    """``None`` means the GPU when there is one: the trainer should never silently train on CPU
    beside an idle GPU, nor fail on a CPU-only machine."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """Default bf16 on CUDA (what vLLM computes in), fp32 on CPU (bf16 matmuls are slow there and
    fp32 keeps recomputed logprobs closest to the recorded ones)."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r} (expected one of {sorted(_DTYPES)})") from None


class TrainerBackend(ABC):
    """One policy being trained: base weights + LoRA adapter + AdamW over the adapter.

    Logprob convention (docs/objectives.md §2): logprobs are vLLM's raw ones — ``log_softmax`` of the logits,
    no temperature — aligned to ``input_ids`` as targets (``trainer.samples``).

    A backend sets ``model``, ``trainable`` (the adapter's parameters) and ``optimizer``
    (``trainer.step.make_optimizer``) when it loads, and implements ``logprobs``; that makes it a
    ``trainer.step.Policy``.
    """

    name: str
    model: nn.Module
    trainable: list[nn.Parameter]
    optimizer: torch.optim.Optimizer

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
    ) -> None:
        if learning_rate <= 0:
            raise ValueError("learning_rate must be positive")
        if grad_clip < 0:
            raise ValueError("grad_clip must be >= 0 (0 disables clipping)")
        if weight_decay < 0:
            raise ValueError("weight_decay must be >= 0")
        if logprob_chunk <= 0:
            raise ValueError("logprob_chunk must be positive")
        self.base_weights = base_weights
        self.lora = lora
        self.learning_rate = learning_rate
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.seed = seed
        self.grad_clip = grad_clip
        self.weight_decay = weight_decay
        self.logprob_chunk = logprob_chunk
        self.step = 0  # optimizer steps taken, restored by load()

    @abstractmethod
    def logprobs(self, batch: dict[str, Tensor], *, trained_only: bool) -> Tensor:
        """[B, T] logprobs of a ``trainer.samples.collate`` batch already on ``self.device``, in
        ``trainer.loss.input_token_logprobs``'s target-aligned layout, differentiable.

        ``trained_only``: only positions where ``loss_mask`` is on need a value (others may be 0);
        backends use it to skip the LM head on context tokens.
        """

    @abstractmethod
    def target_scores(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """``logprobs(batch, trained_only=True)``, and [B, T] bool: whether each trained target is the
        policy's most likely token (SFT's token accuracy; ``trainer.loss.chunked_token_scores``)."""

    def train_step(
        self,
        rows: list[Row],
        loss_config: LossConfig,
        micro_batch_tokens: int,
        progress: Progress | None = None,
        *,
        data_parallel: Collective | None = None,
    ) -> dict[str, float]:
        """One optimizer step over all ``rows`` (``trainer.step.train_step``); with ``data_parallel``,
        over this rank's share of the step, taking the whole step's update (``trainer.distributed``).

        Rows are split with ``trainer.samples.micro_batches`` (padded size ≤ ``micro_batch_tokens``);
        the loss of each micro-batch is normalised by totals of the *whole* step, so the accumulated
        gradient does not depend on the split. Then grad-norm clipping, one AdamW step, gradients
        cleared. ``progress(done, total)`` is called after each micro-batch. Rows without a
        trainable token are skipped (they add nothing to the loss); a step with no trainable token
        at all is an error, never a silent no-op.

        Returns floats: ``loss``, ``grad_norm`` (before clipping), ``ratio_mean/max/min``,
        ``log_ratio_abs_mean``, ``clip_frac``, ``approx_kl`` (token-weighted over the step, on the
        rows' fresh data before the update), ``tis_frac`` (grpo with TIS, gspo), ``tokens``
        (trainable), ``input_tokens`` (real tokens of all rows), ``padded_tokens`` (``B × T`` summed
        over micro-batches: what the model computed, padding included), ``micro_batches``,
        ``seconds``, ``tokens_per_s`` (``input_tokens / seconds``), ``learning_rate``, ``step``. With loss
        ``sft``, ``sft_loss`` (mean cross-entropy per trained token) and ``token_accuracy`` (the share of
        trained tokens that are the policy's argmax) replace the ratio, clip and KL metrics.
        """
        return train_step(self, rows, loss_config, micro_batch_tokens, progress, data_parallel=data_parallel)

    @torch.no_grad()
    def token_logprobs(self, rows: list[Row], micro_batch_tokens: int = 8192) -> list[list[float]]:
        """The current policy's logprob of every token of each row, target-aligned (entry 0 is 0.0),
        without gradients or dropout: diagnostics, and the on-policy check (ratio ≈ 1)."""
        self.model.eval()
        by_row: dict[int, list[float]] = {}
        for rows_mb in micro_batches(rows, micro_batch_tokens):
            batch = {k: v.to(self.device, non_blocking=True) for k, v in collate(rows_mb).items()}
            logprobs = self.logprobs(batch, trained_only=False).cpu()
            for b, row in enumerate(rows_mb):
                by_row[id(row)] = logprobs[b, : len(row)].tolist()
        return [by_row[id(row)] for row in rows]

    @abstractmethod
    def save(self, directory: Path) -> None:
        """Write the adapter where vLLM can load it (``directory`` itself is the ``lora_path``:
        ``adapter_config.json`` with concrete ``target_modules`` + ``adapter_model.safetensors``),
        plus the optimizer state, RNG states and ``trainer_state.json`` (step, lr, LoRA spec)."""

    @abstractmethod
    def load(self, directory: Path) -> None:
        """Restore what ``save`` wrote, so the next step equals an uninterrupted run's.

        Hyperparameters (learning rate, weight decay) stay the ones this backend was built with —
        the run's current config — while adapter weights, optimizer moments, RNG and step count come
        from the checkpoint. A checkpoint of a different LoRA shape is refused.
        """

    def close(self) -> None:
        """Give back what this backend holds in a model it shares with other runs' backends (several runs in
        one trainer, ``HFBackend``'s ``share_base``); a backend with a model of its own holds nothing more."""
        return None

    @abstractmethod
    def flops_per_token(self) -> float:
        """Model FLOPs per token of one training step, for MFU.

        LoRA training is not the usual 6·N: frozen base weights need no weight gradients. The
        count used: every linear layer of the frozen base (LM head included, embedding lookups
        excluded) costs 2·N forward + 2·N for the activation gradients; LoRA matrices cost 6·N
        (forward, activation and weight gradients). Attention score/value products, norms and
        activations are left out (as in 6·N), and so is any recomputation (gradient checkpointing,
        the chunked LM head's recomputed logits): those are hardware FLOPs, not model FLOPs.
        """
