"""One optimizer step over a step's rows, the same for every backend: the algorithm in one place.

    rows with a trained token  →  the step's totals (the loss's normalisers)
    for each micro-batch:         collate → logprobs (the backend) → policy_loss → backward
                                  (SFT: collate → logprobs and argmax hits → sft_loss → backward)
                                  (distill: the same with the rows' teacher logprobs → distill_loss)
    clip the gradient norm  →  one AdamW step  →  the step's metrics

A backend (``trainer.backends``) only loads the model and its adapter, computes per-token logprobs
of a batch, and saves and restores itself; it hands this module a ``Policy``. The objective is
``trainer.loss`` (pure tensors). Gradients of the micro-batches accumulate: each micro-batch's loss
is already its exact share of the step's loss (normalisers computed over the whole step before the
first micro-batch), so the update does not depend on how the rows were split.

Data-parallel (``trainer.distributed``, under torchrun) is the same step with the rows split across
ranks instead of micro-batches: the totals are summed over the ranks before the first micro-batch,
the accumulated gradients are summed over the ranks before clipping, and the metrics are combined
from every rank's micro-batches, so each rank takes the single-process step's update.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from trainer.loss import LossConfig, LossOutput, StepTotals, aggregate_metrics, distill_loss, policy_loss, sft_loss
from trainer.samples import Row, collate, micro_batches

Progress = Callable[[int, int], None]

# What a rank with fewer micro-batches than the others runs under FSDP (``_idle_pass``).
_IDLE_ROW = Row(
    input_ids=[0, 0], loss_mask=[0, 0], behaviour_logprobs=[0.0, 0.0], advantage=0.0, trajectory_id="", group_id=""
)


class Policy(Protocol):
    """What a step needs from a backend: the model (for train mode), its trainable parameters and
    their optimizer, the logprobs of a collated batch, and the step counter it advances."""

    model: nn.Module
    device: torch.device
    trainable: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    learning_rate: float
    grad_clip: float
    step: int

    def logprobs(self, batch: dict[str, Tensor], *, trained_only: bool) -> Tensor: ...

    def target_scores(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """The trained targets' logprobs and whether each is the argmax (loss ``sft`` only)."""
        ...


class Collective(Protocol):
    """The other ranks of a data-parallel step (``trainer.distributed.DataParallel``); every rank calls
    each method in the same order."""

    def all_sum(self, values: Sequence[float]) -> list[float]: ...

    def passes(self, micro_batches: int) -> int:
        """How many forward/backward passes this rank must run for ``micro_batches`` of its own: the
        most any rank has when the ranks shard the model (FSDP: every pass is collective), else its own."""
        ...

    def reduce_gradients(self, params: Sequence[nn.Parameter]) -> None: ...

    def all_gather(self, value: Any) -> list[Any]: ...


def make_optimizer(params: Sequence[nn.Parameter], learning_rate: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW over the adapter's parameters; fused (one kernel for all of them) on CUDA."""
    on_cuda = bool(params) and all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay, fused=on_cuda)


def step_totals(rows: Sequence[Row], loss_config: LossConfig, data_parallel: Collective | None = None) -> StepTotals:
    """The whole step's trained tokens and sequences: a row is a sequence, except that GSPO groups
    rows by ``sequence_id`` (``build_samples`` gives each row its own). Data-parallel, ``rows`` are
    this rank's and the counts are summed over the ranks (``shard_rows`` keeps a sequence on one
    rank), so every rank normalises by the same, global, totals.

    Raises ValueError when the step has no trained token: never a silent no-op.
    """
    sequences = len({row.sequence_id for row in rows}) if loss_config.kind == "gspo" else len(rows)
    tokens = float(sum(row.trainable_tokens for row in rows))
    if data_parallel is not None:
        tokens, sequences_sum = data_parallel.all_sum([tokens, float(sequences)])
        sequences = round(sequences_sum)
    if tokens <= 0:
        raise ValueError("train_step got no trainable tokens: a step must never be a silent no-op")
    return StepTotals(tokens=tokens, sequences=sequences)


def _idle_pass(policy: Policy) -> None:
    """A forward and backward pass that adds nothing to any gradient: under FSDP every rank must run as
    many passes as the busiest (each layer gathers its weights from all ranks), also one without rows."""
    batch = {k: v.to(policy.device) for k, v in collate([_IDLE_ROW]).items()}
    (policy.logprobs(batch, trained_only=False).sum() * 0.0).backward()


def _micro_batch_loss(
    policy: Policy, batch: dict[str, Tensor], totals: StepTotals, loss_config: LossConfig
) -> LossOutput:
    """The configured objective on one collated micro-batch: a policy objective on the logprobs against vLLM's,
    or SFT's cross-entropy (which needs no behaviour logprobs or advantages, and the argmax for its accuracy)."""
    if loss_config.kind == "sft":
        logprobs, hits = policy.target_scores(batch)
        return sft_loss(logprobs, hits, batch["loss_mask"], totals, loss_config)
    if loss_config.kind == "distill":
        return distill_loss(
            policy.logprobs(batch, trained_only=True),
            batch["behaviour_logprobs"],
            batch["teacher_logprobs"],
            batch["advantages"],
            batch["loss_mask"],
            totals,
            loss_config,
        )
    return policy_loss(
        policy.logprobs(batch, trained_only=True),
        batch["behaviour_logprobs"],
        batch["advantages"],
        batch["loss_mask"],
        totals,
        loss_config,
        sequence_ids=batch["sequence_ids"] if loss_config.kind == "gspo" else None,
    )


def train_step(
    policy: Policy,
    rows: list[Row],
    loss_config: LossConfig,
    micro_batch_tokens: int,
    progress: Progress | None = None,
    *,
    data_parallel: Collective | None = None,
) -> dict[str, float]:
    """One optimizer step over all ``rows`` (``TrainerBackend.train_step`` documents the metrics).

    Rows without a trained token are skipped (they add nothing to the loss); a step with no trained
    token at all is an error, never a silent no-op. A non-finite gradient norm leaves the adapter and
    the optimizer untouched and raises.

    ``data_parallel``: ``rows`` are this rank's share of the step (``trainer.distributed.shard_rows``,
    possibly none); every rank returns the whole step's metrics and takes the same update.
    """
    rows = [row for row in rows if row.trainable_tokens > 0]
    if loss_config.kind == "gspo" and any(row.sequence_id < 0 for row in rows):
        raise ValueError("gspo needs every row's sequence_id (build_samples numbers them)")
    if loss_config.kind == "distill" and any(row.teacher_logprobs is None for row in rows):
        raise ValueError("distill needs every row's teacher logprobs (trainer.teacher): it never trains without them")
    totals = step_totals(rows, loss_config, data_parallel)
    batches = micro_batches(rows, micro_batch_tokens)
    # Agreed before the first pass: under FSDP every pass is a collective of all ranks.
    passes = len(batches) if data_parallel is None else data_parallel.passes(len(batches))
    started = time.perf_counter()

    policy.model.train()
    policy.optimizer.zero_grad(set_to_none=True)  # a step that failed midway leaves no stale grads
    loss_sum = torch.zeros((), device=policy.device)
    per_batch: list[dict[str, Tensor]] = []
    padded_tokens = 0
    for done, rows_mb in enumerate(batches, start=1):
        batch = {k: v.to(policy.device, non_blocking=True) for k, v in collate(rows_mb).items()}
        out = _micro_batch_loss(policy, batch, totals, loss_config)
        out.loss.backward()
        loss_sum += out.loss.detach()
        per_batch.append(out.metrics)
        padded_tokens += batch["input_ids"].numel()
        if progress is not None:
            progress(done, len(batches))
    for _ in range(passes - len(batches)):
        _idle_pass(policy)

    if data_parallel is not None:
        data_parallel.reduce_gradients(policy.trainable)
    max_norm = policy.grad_clip if policy.grad_clip > 0 else math.inf
    grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.trainable, max_norm))
    if not math.isfinite(grad_norm):
        policy.optimizer.zero_grad(set_to_none=True)
        raise FloatingPointError(
            f"non-finite gradient norm ({grad_norm}) at step {policy.step + 1}: the adapter and optimizer were "
            "left unchanged"
        )
    policy.optimizer.step()
    policy.optimizer.zero_grad(set_to_none=True)
    policy.step += 1

    loss = float(loss_sum)  # host sync: the timing below includes the device work
    seconds = time.perf_counter() - started
    input_tokens = sum(len(row) for row in rows)
    batch_count = len(batches)
    mine = [{k: float(v) for k, v in m.items()} for m in per_batch]
    if data_parallel is not None:
        # The step's last collective, after the update: it returns once every rank has stepped, so rank 0
        # commits nothing that a rank did not finish.
        ranks = data_parallel.all_gather((mine, loss, seconds, input_tokens, padded_tokens, batch_count))
        mine = [m for rank in ranks for m in rank[0]]
        loss = sum(rank[1] for rank in ranks)
        seconds = max(rank[2] for rank in ranks)
        input_tokens, padded_tokens, batch_count = (sum(rank[i] for rank in ranks) for i in (3, 4, 5))
    metrics = aggregate_metrics(mine)
    metrics["loss"] = loss
    metrics.update(
        grad_norm=grad_norm,
        input_tokens=float(input_tokens),
        padded_tokens=float(padded_tokens),
        micro_batches=float(batch_count),
        seconds=seconds,
        tokens_per_s=input_tokens / seconds,
        learning_rate=policy.learning_rate,
        step=float(policy.step),
    )
    return metrics
