"""GRPO-family policy objectives as pure tensor functions (published forms: reference/objectives.md).

Every per-token tensor is ``[B, T]`` and aligned to ``input_ids`` as targets (see
``trainer.samples``): position ``t`` holds something about token ``input_ids[b, t]`` predicted from
``input_ids[b, :t]``. ``input_token_logprobs`` produces the current policy's logprobs in that layout.

Bypass mode: the behaviour policy is what vLLM actually sampled from, scored by its recorded
logprobs, so the importance ratio is ``r_t = exp(logπ_θ(t) − logπ_b(t))``. vLLM reports *raw*
logprobs (before temperature, top-p, …), so nothing here scales by a temperature either.

Normalisation: every objective returns ``Σ_t mask_t · ℓ_t / total_tokens`` where ``total_tokens`` is
the number of mask-1 tokens in the **whole step**, across all micro-batches (DAPO's token-level
loss). A micro-batch's loss is then its exact share of the step's loss, and summing micro-batch
losses (and accumulating their gradients) gives the full-batch loss and gradient, whatever the
micro-batching.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

LossKind = Literal["grpo", "cispo", "gspo"]


@dataclass(frozen=True)
class LossConfig:
    """Which objective, and its clip ranges.

    - ``grpo``: PPO-clip with DAPO's asymmetric range ``[1 − clip_eps, 1 + clip_eps_high]``.
    - ``cispo``: IS weight clipped to ``[cispo_min_ratio, cispo_max_ratio]``. The paper writes
      ``clip(r, 1 − ε_low, 1 + ε_high)`` and effectively disables the lower bound; DESIGN's default
      ``clip(r, 0, 5)`` is ε_low = 1, ε_high = 4 (ScaleRL's ε_max = 5, ART's default).
    - ``gspo``: sequence-level ratio clipped to ``[1 − gspo_eps, 1 + gspo_eps_high]``; the paper's
      ranges are tiny (3e-4 / 4e-4) because ``s`` is a geometric mean of token ratios.
    - ``tis_cap``: truncated importance sampling for ``grpo`` (see ``policy_loss``); ``None`` = off.
    """

    kind: LossKind = "cispo"
    clip_eps: float = 0.2
    clip_eps_high: float = 0.28
    cispo_max_ratio: float = 5.0
    cispo_min_ratio: float = 0.0
    gspo_eps: float = 3e-4
    gspo_eps_high: float = 4e-4
    tis_cap: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("grpo", "cispo", "gspo"):
            raise ValueError(f"unknown loss kind {self.kind!r} (expected grpo, cispo or gspo)")
        if not (0 <= self.clip_eps < 1 and self.clip_eps_high >= 0):
            raise ValueError("grpo clip range must satisfy 0 <= clip_eps < 1 and clip_eps_high >= 0")
        if not (0 <= self.cispo_min_ratio <= self.cispo_max_ratio):
            raise ValueError("cispo needs 0 <= cispo_min_ratio <= cispo_max_ratio")
        if not (0 <= self.gspo_eps < 1 and self.gspo_eps_high >= 0):
            raise ValueError("gspo clip range must satisfy 0 <= gspo_eps < 1 and gspo_eps_high >= 0")
        if self.tis_cap is not None:
            if self.tis_cap <= 0:
                raise ValueError("tis_cap must be positive")
            if self.kind != "grpo":
                # cispo's clipped IS weight already *is* truncated IS; gspo's ratio is per sequence.
                # Refuse rather than silently double-weight or ignore the setting.
                raise ValueError(f"tis_cap applies to grpo only, not {self.kind} (cispo already truncates its IS weight)")


@dataclass
class LossOutput:
    """``loss``: this micro-batch's share of the step's loss (sum these over micro-batches).

    ``metrics``: detached 0-d tensors over this micro-batch's masked tokens (no host sync here):
    ``tokens``, ``ratio_mean``/``ratio_max``/``ratio_min`` (behaviour ratio π_θ/π_b),
    ``clip_frac`` (fraction of tokens the objective clipped, see each objective), ``approx_kl``
    (k3 estimate of KL(π_b ‖ π_θ)), and for grpo with TIS ``tis_frac`` (fraction of tokens whose IS
    weight hit the cap). Combine micro-batches with ``aggregate_metrics``.
    """

    loss: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# The objectives, per token. Each returns (per-token loss ℓ_t, where clipping was active).
# ---------------------------------------------------------------------------------------------


def _ppo_clip(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> tuple[Tensor, Tensor]:
    """PPO-clip: ``ℓ = −min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A)``.

    Clipped = the min picked the clipped term and it differs from the unclipped one (A > 0 and
    r > 1 + ε_high, or A < 0 and r < 1 − ε_low): those tokens get no gradient.
    """
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * adv
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def _cispo(ratio: Tensor, logprobs: Tensor, adv: Tensor, lo: float, hi: float) -> tuple[Tensor, Tensor]:
    """CISPO: ``ℓ = −sg(clip(r, lo, hi)) · A · logπ_θ``.

    Unlike PPO-clip every token keeps its gradient ``−clip(r)·A·∇logπ_θ``; only the IS weight is
    bounded. (Its *value* is not an objective estimate — it contains logπ_θ — only its gradient is.)
    Clipped = the weight was clamped (r outside ``[lo, hi]``).
    """
    weight = ratio.detach().clamp(lo, hi)
    return -weight * adv * logprobs, (ratio < lo) | (ratio > hi)


def _gspo(
    log_ratio: Tensor, adv: Tensor, mask: Tensor, sequence_ids: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, Tensor]:
    """GSPO: one ratio per sequence, ``s_i = exp(mean_{t ∈ i} (logπ_θ − logπ_b))``, then PPO-clip on it.

    ``s_i`` (and whether it was clipped) is broadcast to every masked token of sequence ``i``:
    ``ℓ_t = −min(s_i·A_t, clip(s_i)·A_t)``. With the step's token-level normalisation a sequence
    therefore weighs ``|o_i| · ℓ_i / total_tokens`` — longer sequences count more, as in DAPO's
    token-level loss — instead of the paper's ``(1/G) Σ_i ℓ_i``; that keeps the loss additive over
    micro-batches like the other objectives. The per-token gradient is
    ``−A·s_i/|o_i| · ∇logπ_θ(t)`` summed over the sequence's ``|o_i|`` tokens.
    """
    ids = torch.unique(sequence_ids, return_inverse=True)[1]  # [B, T] → 0..S-1
    num_seqs = int(ids.max()) + 1
    on = mask > 0
    weights = mask.to(log_ratio.dtype)
    log_ratio_sum = torch.zeros(num_seqs, dtype=log_ratio.dtype, device=log_ratio.device)
    log_ratio_sum = log_ratio_sum.index_add(0, ids.flatten(), (log_ratio * weights).flatten())
    counts = torch.zeros_like(log_ratio_sum).index_add(0, ids.flatten(), weights.flatten())
    seq_ratio = torch.exp(log_ratio_sum / counts.clamp(min=1))  # [S]
    s = seq_ratio[ids]  # broadcast back to tokens
    loss, clipped = _ppo_clip(s, adv, eps_low, eps_high)
    return loss, clipped & on


# ---------------------------------------------------------------------------------------------
# The step's loss
# ---------------------------------------------------------------------------------------------


def policy_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    total_tokens: int | Tensor,
    config: LossConfig = LossConfig(),
    *,
    sequence_ids: Tensor | None = None,
    old_logprobs: Tensor | None = None,
) -> LossOutput:
    """The configured objective on one micro-batch, normalised by the step's ``total_tokens``.

    Args:
        logprobs: [B, T] current policy's logprob of each target (differentiable).
        behaviour_logprobs: [B, T] vLLM's recorded logprob of the same targets (0 where unmasked).
        advantages: [B] (one per row) or [B, T].
        loss_mask: [B, T], 1 on trained targets (fractional weights also work).
        total_tokens: mask-1 tokens in the whole step, all micro-batches (``SampleBatch.trainable_tokens``).
        config: which objective and its clip ranges.
        sequence_ids: GSPO only: [B] or [B, T] ids of the sequence-level ratio each token belongs to;
            default one sequence per row. A sequence must not span micro-batches.
        old_logprobs: grpo + TIS only: [B, T] the trainer's own logprobs at the step's starting
            weights θ_old, computed without grad. Needed only when one batch serves several
            optimizer updates; by default θ_old is the weights ``logprobs`` were computed with.

    Truncated IS (``tis_cap``, grpo): following Yao et al. the vLLM→trainer mismatch is corrected by
    a per-token weight ``w = sg(min(π_old/π_b, C))`` and PPO's ratio is taken against the trainer's
    own ``π_old``: ``ℓ = −w · min(ρ·A, clip(ρ)·A)`` with ``ρ = π_θ/π_old``. In the default one
    update per batch ``π_old = sg(π_θ)``, so ρ ≡ 1, the clip is inactive, and the gradient is
    ``−min(π_θ/π_b, C)·A·∇logπ_θ`` — which is exactly CISPO with ``clip(r, 0, C)``, hence TIS is
    refused for cispo. (Multiplying the bypass PPO term ``r·A`` by ``min(r, C)`` instead would weight
    each token by r twice.)
    """
    if isinstance(total_tokens, Tensor):
        total_tokens = total_tokens.detach()
    if total_tokens <= 0:
        raise ValueError("total_tokens must be positive: a step with no trainable tokens cannot train")
    if old_logprobs is not None and not (config.kind == "grpo" and config.tis_cap is not None):
        raise ValueError("old_logprobs is used only by grpo with tis_cap")

    # At least float32 (bf16 logprobs would make ratios of nearly equal numbers meaningless).
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    mask = loss_mask.to(dtype)
    on = mask > 0
    logprobs = logprobs.to(dtype)
    behaviour = behaviour_logprobs.to(dtype)
    adv = advantages.to(dtype)
    adv = adv[:, None] if adv.dim() == 1 else adv
    adv = adv.expand_as(logprobs)

    # log r_t, exactly 0 off the mask (so padding never produces an inf or a gradient)
    log_ratio = torch.where(on, logprobs - behaviour, torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)

    extra: dict[str, Tensor] = {}
    if config.kind == "grpo" and config.tis_cap is None:
        per_token, clipped = _ppo_clip(ratio, adv, config.clip_eps, config.clip_eps_high)
    elif config.kind == "grpo":
        old = logprobs.detach() if old_logprobs is None else old_logprobs.to(dtype)
        zero = torch.zeros_like(logprobs)
        is_ratio = torch.exp(torch.where(on, old - behaviour, zero))
        weight = is_ratio.clamp(max=config.tis_cap)
        ppo_ratio = torch.exp(torch.where(on, logprobs - old, zero))
        per_token, clipped = _ppo_clip(ppo_ratio, adv, config.clip_eps, config.clip_eps_high)
        per_token = weight * per_token
        extra["tis_frac"] = _masked_mean(is_ratio > config.tis_cap, on)
    elif config.kind == "cispo":
        per_token, clipped = _cispo(ratio, logprobs, adv, config.cispo_min_ratio, config.cispo_max_ratio)
    else:
        if sequence_ids is None:
            sequence_ids = torch.arange(logprobs.shape[0], device=logprobs.device)
        if sequence_ids.dim() == 1:
            sequence_ids = sequence_ids[:, None]
        sequence_ids = sequence_ids.expand_as(logprobs)
        per_token, clipped = _gspo(log_ratio, adv, mask, sequence_ids, config.gspo_eps, config.gspo_eps_high)

    loss = torch.where(on, per_token * mask, torch.zeros_like(per_token)).sum() / total_tokens

    with torch.no_grad():
        inf = torch.full_like(ratio, float("inf"))
        metrics = {
            "tokens": on.sum().to(torch.float32),
            "ratio_mean": _masked_mean(ratio, on),
            "ratio_max": torch.where(on, ratio, -inf).max(),  # -inf / +inf when nothing is masked
            "ratio_min": torch.where(on, ratio, inf).min(),
            "clip_frac": _masked_mean(clipped, on),
            # k3: E_{x~π_b}[r − 1 − log r] ≥ 0 estimates KL(π_b ‖ π_θ) without bias.
            "approx_kl": _masked_mean(ratio - 1 - log_ratio, on),
            **extra,
        }
    return LossOutput(loss=loss, metrics={k: v.detach() for k, v in metrics.items()})


def _masked_mean(values: Tensor, on: Tensor) -> Tensor:
    values = values.to(torch.promote_types(values.dtype, torch.float32))
    return torch.where(on, values, torch.zeros_like(values)).sum() / on.sum().clamp(min=1)


def aggregate_metrics(per_micro_batch: Sequence[dict[str, Tensor]]) -> dict[str, float]:
    """Combine micro-batch metrics into the step's: token-weighted means, max of maxes, min of mins.

    Converts to Python floats (one host sync per step, not per micro-batch). Micro-batches without
    masked tokens are skipped.
    """
    parts = [m for m in per_micro_batch if float(m["tokens"]) > 0]
    total = sum(float(m["tokens"]) for m in parts)
    if not parts:
        return {"tokens": 0.0}
    out: dict[str, float] = {"tokens": total}
    for key in parts[0]:
        if key == "tokens":
            continue
        values = [float(m[key]) for m in parts if key in m]
        if key.endswith("_max"):
            out[key] = max(values)
        elif key.endswith("_min"):
            out[key] = min(values)
        else:
            out[key] = sum(float(m[key]) * float(m["tokens"]) for m in parts if key in m) / total
    return out


# ---------------------------------------------------------------------------------------------
# Logprobs of the targets without materialising [B, T, V]
# ---------------------------------------------------------------------------------------------


def _chunk_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, dtype: torch.dtype | None) -> Tensor:
    """log_softmax(hidden @ weightᵀ)[targets] for one chunk of positions: [n, H], [V, H], [n] → [n]."""
    if dtype is not None:
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    logits = (hidden @ weight.T).float()  # [n, V]
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def chunked_token_logprobs(
    hidden: Tensor,
    lm_head_weight: Tensor,
    targets: Tensor,
    chunk: int = 1024,
    *,
    compute_dtype: torch.dtype | None = torch.float32,
) -> Tensor:
    """``log_softmax(hidden @ Wᵀ)`` gathered at ``targets``, ``chunk`` positions at a time.

    ``hidden`` [B, T, H] are the final hidden states (after the model's last norm, what the LM head
    multiplies), ``lm_head_weight`` is [V, H], ``targets`` [B, T]; returns [B, T] float32. No
    temperature: vLLM's logprobs are raw (DESIGN §3). Models with a logit soft-cap or scale, or an
    LM-head bias, need their own variant.

    Memory: the B·T positions are processed ``chunk`` at a time, so at most ``[chunk, V]`` logits
    exist at once; each chunk runs under ``torch.utils.checkpoint``, so the backward recomputes a
    chunk's logits instead of keeping every chunk's alive (only the chunk inputs are saved).

    ``compute_dtype`` (default float32) is the matmul's dtype: MiniMax-M1 found a bf16 LM head a
    main source of train/inference probability mismatch. The weight is cast inside each chunk (a
    transient copy, recomputed in backward) rather than kept as a float32 copy for the whole step.
    ``None`` multiplies in the inputs' dtype and upcasts the logits only.
    """
    if chunk <= 0:
        raise ValueError("chunk must be positive")
    B, T, H = hidden.shape
    flat_hidden = hidden.reshape(B * T, H)
    flat_targets = targets.reshape(B * T)
    pieces = [
        checkpoint(
            _chunk_logprobs,
            flat_hidden[start : start + chunk],
            lm_head_weight,
            flat_targets[start : start + chunk],
            compute_dtype,
            use_reentrant=False,
        )
        for start in range(0, B * T, chunk)
    ]
    if not pieces:
        return hidden.new_zeros((B, T), dtype=torch.float32)
    return torch.cat(pieces).reshape(B, T)


def input_token_logprobs(
    hidden: Tensor,
    lm_head_weight: Tensor,
    input_ids: Tensor,
    chunk: int = 1024,
    *,
    compute_dtype: torch.dtype | None = torch.float32,
) -> Tensor:
    """The logprob of every input token given the tokens before it, aligned to ``input_ids``.

    Out ``[b, t] = log π(input_ids[b, t] | input_ids[b, :t])``, scored by the hidden state at
    ``t − 1``; column 0 has no prediction and is 0 (``loss_mask`` is never 1 there). This is the
    layout ``policy_loss`` and ``trainer.samples.collate`` use.
    """
    shifted = chunked_token_logprobs(
        hidden[:, :-1], lm_head_weight, input_ids[:, 1:], chunk, compute_dtype=compute_dtype
    )
    return F.pad(shifted, (1, 0), value=0.0)
