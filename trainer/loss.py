"""GRPO-family policy objectives, on-policy distillation's reverse KL, and SFT's cross-entropy, as pure tensor
functions (published forms: docs/objectives.md).

Every per-token tensor is ``[B, T]`` and aligned to ``input_ids`` as targets (see
``trainer.samples``): position ``t`` holds something about token ``input_ids[b, t]`` predicted from
``input_ids[b, :t]``. ``input_token_logprobs`` produces the current policy's logprobs in that layout.

Bypass mode: the behaviour policy is what vLLM actually sampled from, scored by its recorded
logprobs, so the importance ratio is ``r_t = exp(logπ_θ(t) − logπ_b(t))``. vLLM reports *raw*
logprobs (before temperature, top-p, …), so nothing here scales by a temperature either.

Aggregation (``LossConfig.aggregation``) turns per-token losses ``ℓ_t`` into the step's loss. With
``m_t`` the loss mask, ``N`` the trained tokens of the whole step, ``S`` its sequences, ``|o_i|`` the
trained tokens of sequence ``i`` and ``C`` a constant:

- ``token`` (DAPO, the default): ``Σ_t m_t ℓ_t / N``;
- ``sequence`` (DeepSeekMath's GRPO): ``(1/S) Σ_i (1/|o_i|) Σ_{t∈i} m_t ℓ_t``;
- ``constant`` (Dr. GRPO): ``Σ_t m_t ℓ_t / (S · C)``.

``N`` and ``S`` are the whole step's (``StepTotals``), across all micro-batches, and ``|o_i|`` is
local to a sequence (which never spans micro-batches): a micro-batch's loss is then its exact share
of the step's loss, and summing micro-batch losses (and accumulating their gradients) gives the
full-batch loss and gradient, whatever the micro-batching.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

LossKind = Literal["grpo", "cispo", "gspo", "sft", "distill"]
Aggregation = Literal["token", "sequence", "constant"]


@dataclass(frozen=True)
class LossConfig:
    """Which objective, its clip ranges, and how per-token losses are aggregated.

    - ``grpo``: PPO-clip with DAPO's asymmetric range ``[1 − clip_eps, 1 + clip_eps_high]``.
    - ``cispo``: IS weight clipped to ``[cispo_min_ratio, cispo_max_ratio]``. The paper writes
      ``clip(r, 1 − ε_low, 1 + ε_high)`` and effectively disables the lower bound; the run config's
      default (docs/objectives.md §3.3) ``clip(r, 0, 5)`` is ε_low = 1, ε_high = 4 (ScaleRL's ε_max = 5, ART's default).
    - ``gspo``: sequence-level ratio against the trainer's own π_old, clipped to
      ``[1 − gspo_clip_eps, 1 + gspo_clip_eps_high]`` (the paper's 3e-4 / 4e-4: ``s`` is a geometric
      mean of token ratios), times a truncated IS weight for the vLLM gap capped at ``gspo_is_cap``.
    - ``sft``: cross-entropy on the trained tokens (``sft_loss``); no ratio, no advantage, no clip.
    - ``distill``: on-policy distillation (``distill_loss``): grpo's PPO-clip with the per-token advantage
      ``log π_teacher − log π_b`` plus ``distill_reward_weight`` times the row's group advantage.
    - ``tis_cap``: truncated importance sampling for ``grpo`` (see ``policy_loss``); ``None`` = off.
    - ``aggregation``/``norm_tokens``: see the module docstring; ``norm_tokens`` is ``constant``'s C.
    """

    kind: LossKind = "cispo"
    clip_eps: float = 0.2
    clip_eps_high: float = 0.28
    cispo_max_ratio: float = 5.0
    cispo_min_ratio: float = 0.0
    gspo_clip_eps: float = 3e-4
    gspo_clip_eps_high: float = 4e-4
    gspo_is_cap: float = 2.0
    tis_cap: float | None = None
    aggregation: Aggregation = "token"
    norm_tokens: int | None = None
    distill_reward_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("grpo", "cispo", "gspo", "sft", "distill"):
            raise ValueError(f"unknown loss kind {self.kind!r} (expected grpo, cispo, gspo, sft or distill)")
        if not (math.isfinite(self.distill_reward_weight) and self.distill_reward_weight >= 0):
            raise ValueError("distill_reward_weight must be finite and >= 0")
        if self.distill_reward_weight and self.kind != "distill":
            raise ValueError("distill_reward_weight applies to kind 'distill' only")
        if not (0 <= self.clip_eps < 1 and self.clip_eps_high >= 0):
            raise ValueError("grpo clip range must satisfy 0 <= clip_eps < 1 and clip_eps_high >= 0")
        if not (0 <= self.cispo_min_ratio <= self.cispo_max_ratio):
            raise ValueError("cispo needs 0 <= cispo_min_ratio <= cispo_max_ratio")
        if not (0 <= self.gspo_clip_eps < 1 and self.gspo_clip_eps_high >= 0):
            raise ValueError("gspo clip range must satisfy 0 <= gspo_clip_eps < 1 and gspo_clip_eps_high >= 0")
        if not self.gspo_is_cap > 0:
            raise ValueError("gspo_is_cap must be positive")
        if self.tis_cap is not None:
            if self.tis_cap <= 0:
                raise ValueError("tis_cap must be positive")
            if self.kind != "grpo":
                # cispo's clipped IS weight already *is* truncated IS; gspo has its own sequence-level
                # cap. Refuse rather than silently double-weight or ignore the setting.
                raise ValueError(
                    f"tis_cap applies to grpo only, not {self.kind} (cispo already truncates its IS weight, "
                    "gspo has gspo_is_cap)"
                )
        if self.aggregation not in ("token", "sequence", "constant"):
            raise ValueError(f"unknown aggregation {self.aggregation!r} (expected token, sequence or constant)")
        if (self.aggregation == "constant") != (self.norm_tokens is not None):
            raise ValueError("norm_tokens is the constant of aggregation 'constant': set it exactly for that one")
        if self.norm_tokens is not None and self.norm_tokens <= 0:
            raise ValueError("norm_tokens must be positive")


@dataclass(frozen=True)
class StepTotals:
    """What the whole step holds, computed once before its first micro-batch: the normalisers.

    ``tokens``: trained (mask-1) tokens (the mask's sum); ``sequences``: sequences with at least one
    trained token.
    """

    tokens: float
    sequences: int

    def __post_init__(self) -> None:
        if self.tokens <= 0 or self.sequences <= 0:
            raise ValueError("a step with no trainable tokens cannot train")


@dataclass
class LossOutput:
    """``loss``: this micro-batch's share of the step's loss (sum these over micro-batches).

    ``metrics``: detached 0-d tensors over this micro-batch's masked tokens (no host sync here):
    ``tokens``, ``ratio_mean``/``ratio_max``/``ratio_min`` (behaviour ratio π_θ/π_b),
    ``log_ratio_abs_mean`` (mean ``|logπ_θ − logπ_b|``: on fresh data, how far the trainer's policy
    is from the one vLLM sampled), ``clip_frac`` (fraction of tokens the objective clipped, see each
    objective), ``approx_kl`` (k3 estimate of KL(π_b ‖ π_θ)), and for grpo with TIS and for gspo
    ``tis_frac`` (fraction of tokens whose IS weight hit the cap). ``sft_loss`` reports ``tokens``,
    ``sft_loss`` and ``token_accuracy`` instead. Combine micro-batches with ``aggregate_metrics``.
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


class _Sequences:
    """Which sequence each token belongs to, and per-sequence sums over the masked tokens."""

    def __init__(self, sequence_ids: Tensor, mask: Tensor) -> None:
        self.index = torch.unique(sequence_ids, return_inverse=True)[1]  # [B, T] → 0..S-1
        self.count = int(self.index.max()) + 1
        self.mask = mask
        self.lengths = self.sum(torch.ones_like(mask))  # |o_i|, masked tokens (or mask weights)

    def sum(self, values: Tensor) -> Tensor:
        """``Σ_{t∈i} m_t · values_t`` for every sequence ``i``: [S]."""
        out = torch.zeros(self.count, dtype=values.dtype, device=values.device)
        return out.index_add(0, self.index.flatten(), (values * self.mask).flatten())

    def mean(self, values: Tensor) -> Tensor:
        """The masked mean over each sequence's tokens: [S]."""
        return self.sum(values) / self.lengths.clamp(min=torch.finfo(self.lengths.dtype).tiny)

    def per_token(self, per_sequence: Tensor) -> Tensor:
        """Broadcast one value per sequence back to its tokens: [S] → [B, T]."""
        return per_sequence[self.index]


def _gspo(
    logprobs: Tensor, old: Tensor, behaviour: Tensor, adv: Tensor, seqs: _Sequences, config: LossConfig
) -> tuple[Tensor, Tensor, Tensor]:
    """GSPO with the vLLM gap corrected by truncated IS; returns (ℓ_t, clipped, weight capped).

    ``s_i = exp(mean_{t∈i}(logπ_θ − logπ_old))`` is the paper's sequence ratio against the trainer's
    own π_old, PPO-clipped with the paper's tiny range. The behaviour policy is vLLM's, so the
    sequence is weighted by ``w_i = sg(min(exp(mean_{t∈i}(logπ_old − logπ_b)), C))``: the
    length-normalised (geometric-mean) IS ratio old/vLLM, truncated at ``C`` as in TIS. The product
    ``s_i · g_i`` (untruncated) is exactly the ratio against vLLM that GSPO was naively given before;
    separating the factors lets the clip act on the policy change only — vLLM-vs-trainer numeric
    noise (|Δlogπ| ≈ 0.02 per token) moves ``g_i`` by far more than 4e-4 and would otherwise clip
    about every sequence whose advantage points the way the noise does.

    With one optimizer step per batch π_old is the current weights, ``old = sg(logπ_θ)``: ``s_i`` is
    1 in value (nothing is clipped) and ``∇s_i = mean_{t∈i} ∇logπ_θ(t)``, the paper's on-policy
    gradient. ``ℓ_t = −w_i · min(s_i A_t, clip(s_i) A_t)`` on every token of sequence ``i``; with
    ``sequence`` aggregation that is the paper's ``(1/G) Σ_i`` exactly.
    """
    s = torch.exp(seqs.mean(logprobs - old))
    gap = torch.exp(seqs.mean(old - behaviour)).detach()
    weight = gap.clamp(max=config.gspo_is_cap)
    loss, clipped = _ppo_clip(seqs.per_token(s), adv, config.gspo_clip_eps, config.gspo_clip_eps_high)
    return seqs.per_token(weight) * loss, clipped, seqs.per_token(gap > config.gspo_is_cap)


# ---------------------------------------------------------------------------------------------
# The step's loss
# ---------------------------------------------------------------------------------------------


def _token_weights(config: LossConfig, mask: Tensor, totals: StepTotals, seqs: _Sequences | None) -> Tensor:
    """Each token's factor in the step's loss (the aggregation, module docstring): [B, T]."""
    if config.aggregation == "token":
        return mask / totals.tokens
    if config.aggregation == "constant":
        assert config.norm_tokens is not None  # LossConfig checked it
        return mask / (totals.sequences * config.norm_tokens)
    assert seqs is not None
    return mask / (seqs.per_token(seqs.lengths).clamp(min=torch.finfo(mask.dtype).tiny) * totals.sequences)


def policy_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    totals: StepTotals | float | Tensor,
    config: LossConfig = LossConfig(),
    *,
    sequence_ids: Tensor | None = None,
    old_logprobs: Tensor | None = None,
) -> LossOutput:
    """The configured objective on one micro-batch, aggregated with the step's normalisers.

    Args:
        logprobs: [B, T] current policy's logprob of each target (differentiable).
        behaviour_logprobs: [B, T] vLLM's recorded logprob of the same targets (0 where unmasked).
        advantages: [B] (one per row) or [B, T].
        loss_mask: [B, T], 1 on trained targets (fractional weights also work).
        totals: the whole step's ``StepTotals``, all micro-batches. A bare count of trained tokens is
            accepted for the ``token`` aggregation, the only one that needs nothing else.
        config: which objective, its clip ranges and the aggregation.
        sequence_ids: [B] or [B, T] ids of the sequence each token belongs to (GSPO's ratio, the
            ``sequence``/``constant`` aggregations); default one sequence per row. A sequence must
            not span micro-batches.
        old_logprobs: grpo + TIS and gspo: [B, T] the trainer's own logprobs at the step's starting
            weights θ_old, computed without grad. Needed only when one batch serves several
            optimizer updates; by default θ_old is the weights ``logprobs`` were computed with.

    Truncated IS (``tis_cap``, grpo): following Yao et al. the vLLM→trainer mismatch is corrected by
    a per-token weight ``w = sg(min(π_old/π_b, C))`` and PPO's ratio is taken against the trainer's
    own ``π_old``: ``ℓ = −w · min(ρ·A, clip(ρ)·A)`` with ``ρ = π_θ/π_old``. In the default one
    update per batch ``π_old = sg(π_θ)``, so ρ ≡ 1, the clip is inactive, and the gradient is
    ``−min(π_θ/π_b, C)·A·∇logπ_θ`` — which is exactly CISPO with ``clip(r, 0, C)``, hence TIS is
    refused for cispo. (Multiplying the bypass PPO term ``r·A`` by ``min(r, C)`` instead would weight
    each token by r twice.) GSPO does the same per sequence (``_gspo``).
    """
    if not isinstance(totals, StepTotals):
        tokens = float(totals.detach()) if isinstance(totals, Tensor) else float(totals)
        if tokens <= 0:
            raise ValueError("total_tokens must be positive: a step with no trainable tokens cannot train")
        if config.aggregation != "token":
            raise ValueError(f"aggregation {config.aggregation!r} needs the step's StepTotals, not a token count")
        totals = StepTotals(tokens=tokens, sequences=1)
    if config.kind == "sft":
        raise ValueError("loss 'sft' is sft_loss: a cross-entropy, not a policy objective")
    if config.kind == "distill":
        raise ValueError("loss 'distill' is distill_loss: its advantages come from the teacher's logprobs")
    if old_logprobs is not None and not (config.kind == "gspo" or config.tis_cap is not None):
        raise ValueError("old_logprobs is used only by gspo and by grpo with tis_cap")

    # At least float32 (bf16 logprobs would make ratios of nearly equal numbers meaningless).
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    mask = loss_mask.to(dtype)
    on = mask > 0
    logprobs = logprobs.to(dtype)
    behaviour = behaviour_logprobs.to(dtype)
    zero = torch.zeros_like(logprobs)
    old = logprobs.detach() if old_logprobs is None else old_logprobs.to(dtype)
    adv = advantages.to(dtype)
    adv = adv[:, None] if adv.dim() == 1 else adv
    adv = adv.expand_as(logprobs)

    seqs = None
    if config.kind == "gspo" or config.aggregation == "sequence":
        if sequence_ids is None:
            sequence_ids = torch.arange(logprobs.shape[0], device=logprobs.device)
        if sequence_ids.dim() == 1:
            sequence_ids = sequence_ids[:, None]
        seqs = _Sequences(sequence_ids.expand_as(logprobs), mask)

    # log r_t, exactly 0 off the mask (so padding never produces an inf or a gradient)
    log_ratio = torch.where(on, logprobs - behaviour, zero)
    ratio = torch.exp(log_ratio)

    extra: dict[str, Tensor] = {}
    if config.kind == "grpo" and config.tis_cap is None:
        per_token, clipped = _ppo_clip(ratio, adv, config.clip_eps, config.clip_eps_high)
    elif config.kind == "grpo" and config.tis_cap is not None:
        is_ratio = torch.exp(torch.where(on, old - behaviour, zero))
        weight = is_ratio.clamp(max=config.tis_cap)
        ppo_ratio = torch.exp(torch.where(on, logprobs - old, zero))
        per_token, clipped = _ppo_clip(ppo_ratio, adv, config.clip_eps, config.clip_eps_high)
        per_token = weight * per_token
        extra["tis_frac"] = _masked_mean(is_ratio > config.tis_cap, on)
    elif config.kind == "cispo":
        per_token, clipped = _cispo(ratio, logprobs, adv, config.cispo_min_ratio, config.cispo_max_ratio)
    else:
        assert seqs is not None
        masked = torch.where(on, logprobs, zero), torch.where(on, old, zero), torch.where(on, behaviour, zero)
        per_token, clipped, capped = _gspo(*masked, adv, seqs, config)
        extra["tis_frac"] = _masked_mean(capped, on)

    weights = _token_weights(config, mask, totals, seqs)
    loss = torch.where(on, per_token * weights, zero).sum()

    with torch.no_grad():
        inf = torch.full_like(ratio, float("inf"))
        metrics = {
            "tokens": on.sum().to(torch.float32),
            "ratio_mean": _masked_mean(ratio, on),
            "ratio_max": torch.where(on, ratio, -inf).max(),  # -inf / +inf when nothing is masked
            "ratio_min": torch.where(on, ratio, inf).min(),
            "log_ratio_abs_mean": _masked_mean(log_ratio.abs(), on),
            "clip_frac": _masked_mean(clipped & on, on),
            # k3: E_{x~π_b}[r − 1 − log r] ≥ 0 estimates KL(π_b ‖ π_θ) without bias.
            "approx_kl": _masked_mean(ratio - 1 - log_ratio, on),
            **extra,
        }
    return LossOutput(loss=loss, metrics={k: v.detach() for k, v in metrics.items()})


def sft_loss(
    logprobs: Tensor,
    hits: Tensor,
    loss_mask: Tensor,
    totals: StepTotals,
    config: LossConfig,
    *,
    sequence_ids: Tensor | None = None,
) -> LossOutput:
    """Supervised fine-tuning on one micro-batch: ``ℓ_t = −log π_θ(t)`` on every trained token, aggregated
    with the step's normalisers like the policy objectives (``token``: the mean cross-entropy of the step's
    trained tokens).

    The trained tokens are the ones the policy sampled (``loss_mask``), so this is the cross-entropy against
    what was recorded; the behaviour logprobs and advantages play no part.

    Args:
        logprobs: [B, T] current policy's logprob of each target (differentiable).
        hits: [B, T] bool, whether each target is the policy's most likely token (its argmax).
        loss_mask: [B, T], 1 on trained targets.
        totals, config: the step's ``StepTotals`` and the aggregation (``config.kind`` must be ``sft``).
        sequence_ids: as in ``policy_loss``, for the ``sequence`` aggregation; default one per row.

    Metrics: ``tokens``, ``sft_loss`` (the mean cross-entropy per trained token, whatever the aggregation)
    and ``token_accuracy`` (the share of trained tokens that are the argmax).
    """
    if config.kind != "sft":
        raise ValueError(f"sft_loss is the loss of kind 'sft', not {config.kind!r}")
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    mask = loss_mask.to(dtype)
    on = mask > 0
    logprobs = logprobs.to(dtype)
    seqs = None
    if config.aggregation == "sequence":
        if sequence_ids is None:
            sequence_ids = torch.arange(logprobs.shape[0], device=logprobs.device)
        if sequence_ids.dim() == 1:
            sequence_ids = sequence_ids[:, None]
        seqs = _Sequences(sequence_ids.expand_as(logprobs), mask)
    cross_entropy = torch.where(on, -logprobs, torch.zeros_like(logprobs))  # 0 off the mask: padding has no gradient
    loss = (cross_entropy * _token_weights(config, mask, totals, seqs)).sum()
    with torch.no_grad():
        metrics = {
            "tokens": on.sum().to(torch.float32),
            "sft_loss": _masked_mean(cross_entropy, on),
            "token_accuracy": _masked_mean(hits & on, on),
        }
    return LossOutput(loss=loss, metrics={k: v.detach() for k, v in metrics.items()})


# A trained token the teacher gives at least this probability is one it agrees with: at p ≥ ½ it is the teacher's
# most likely token whatever the rest of the distribution.
TEACHER_AGREEMENT_LOGPROB = math.log(0.5)


def distill_advantages(
    teacher_logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor, reward_weight: float
) -> Tensor:
    """On-policy distillation's per-token advantage, ``A_t = log π_teacher(t) − log π_b(t) + w · A_i`` on the trained
    tokens (0 elsewhere), detached: [B, T].

    ``log π_b`` is the student's logprob recorded by vLLM when it sampled the token, not the trainer's current one:
    ``−A_t`` is then the one-sample estimate of the reverse KL ``KL(π_student ‖ π_teacher)`` at that token under the
    distribution the token was drawn from, the reward the policy-gradient surrogate's importance ratio corrects for
    (as in the Tinker cookbook's on-policy distillation, where the sampler's logprobs give the KL penalty). It is also
    fixed before the step, so every micro-batch and a retried step use the same advantage. ``A_i`` is the row's group
    advantage (``advantages`` [B] or [B, T]), weighted by ``reward_weight`` (0: pure distillation).
    """
    on = loss_mask > 0
    reward = advantages[:, None] if advantages.dim() == 1 else advantages
    per_token = teacher_logprobs - behaviour_logprobs + reward_weight * reward.expand_as(teacher_logprobs)
    return torch.where(on, per_token, torch.zeros_like(per_token)).detach()


def distill_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    teacher_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    totals: StepTotals,
    config: LossConfig,
) -> LossOutput:
    """On-policy distillation on one micro-batch: grpo's PPO-clip surrogate (ratio against vLLM's behaviour logprobs,
    ``[1 − clip_eps, 1 + clip_eps_high]``) with ``distill_advantages`` as the per-token advantage, aggregated like every
    objective. At ratio 1 (fresh data) the gradient is ``Σ_t m_t w_t (log π_θ(t) − log π_teacher(t)) ∇log π_θ(t)``:
    the per-token reverse-KL policy gradient (GKD's on-policy, reverse-KL case).

    Args: as ``policy_loss``; ``teacher_logprobs`` [B, T] aligned like ``behaviour_logprobs``; ``advantages`` the
    rows' group advantages (used only with ``config.distill_reward_weight`` > 0).

    Metrics: ``policy_loss``'s (ratio, clip, approx_kl), and ``reverse_kl`` (the mean over trained tokens of
    ``log π_b − log π_teacher``, the estimate of KL(π_student ‖ π_teacher) per token) and ``teacher_agreement`` (the
    share of trained tokens with ``log π_teacher ≥ log ½``: tokens the teacher would most likely have chosen too).
    """
    if config.kind != "distill":
        raise ValueError(f"distill_loss is the loss of kind 'distill', not {config.kind!r}")
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    teacher, behaviour = teacher_logprobs.to(dtype), behaviour_logprobs.to(dtype)
    per_token = distill_advantages(teacher, behaviour, advantages.to(dtype), loss_mask, config.distill_reward_weight)
    out = policy_loss(
        logprobs, behaviour, per_token, loss_mask, totals, replace(config, kind="grpo", distill_reward_weight=0.0)
    )
    on = loss_mask > 0
    with torch.no_grad():
        out.metrics["reverse_kl"] = _masked_mean(behaviour - teacher, on)
        out.metrics["teacher_agreement"] = _masked_mean(teacher >= TEACHER_AGREEMENT_LOGPROB, on)
    return out


def _masked_mean(values: Tensor, on: Tensor) -> Tensor:
    values = values.to(torch.promote_types(values.dtype, torch.float32))
    return torch.where(on, values, torch.zeros_like(values)).sum() / on.sum().clamp(min=1)


def aggregate_metrics(per_micro_batch: Sequence[Mapping[str, Tensor | float]]) -> dict[str, float]:
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


def _chunk_logprobs(
    hidden: Tensor, weight: Tensor, targets: Tensor, dtype: torch.dtype | None, with_hits: bool
) -> tuple[Tensor, Tensor]:
    """log_softmax(hidden @ weightᵀ)[targets] for one chunk of positions: [n, H], [V, H], [n] → [n]; and, with
    ``with_hits``, whether each target is the argmax ([n] bool; else an empty tensor)."""
    if dtype is not None:
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    logits = (hidden @ weight.T).float()  # [n, V]
    logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    hits = logits.argmax(dim=-1) == targets if with_hits else targets.new_zeros(0, dtype=torch.bool)
    return logprobs, hits


def _chunked(
    hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int, dtype: torch.dtype | None, with_hits: bool
) -> tuple[Tensor, Tensor]:
    """``_chunk_logprobs`` over ``chunk`` positions at a time, each under ``checkpoint``: [B, T] logprobs, and
    [B, T] hits with ``with_hits`` (else an empty tensor)."""
    if chunk <= 0:
        raise ValueError("chunk must be positive")
    B, T, H = hidden.shape
    flat_hidden = hidden.reshape(B * T, H)
    flat_targets = targets.reshape(B * T)
    pieces = [
        checkpoint(
            _chunk_logprobs,
            flat_hidden[start : start + chunk],
            weight,
            flat_targets[start : start + chunk],
            dtype,
            with_hits,
            use_reentrant=False,
        )
        for start in range(0, B * T, chunk)
    ]
    if not pieces:
        hits = targets.new_zeros((B, T) if with_hits else (0,), dtype=torch.bool)
        return hidden.new_zeros((B, T), dtype=torch.float32), hits
    logprobs = torch.cat([lp for lp, _ in pieces]).reshape(B, T)
    hits = torch.cat([hit for _, hit in pieces])
    return logprobs, hits.reshape(B, T) if with_hits else hits


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
    temperature: vLLM's logprobs are raw (docs/objectives.md §2). Models with a logit soft-cap or scale, or an
    LM-head bias, need their own variant.

    Memory: the B·T positions are processed ``chunk`` at a time, so at most ``[chunk, V]`` logits
    exist at once; each chunk runs under ``torch.utils.checkpoint``, so the backward recomputes a
    chunk's logits instead of keeping every chunk's alive (only the chunk inputs are saved).

    ``compute_dtype`` (default float32) is the matmul's dtype: MiniMax-M1 found a bf16 LM head a
    main source of train/inference probability mismatch. The weight is cast inside each chunk (a
    transient copy, recomputed in backward) rather than kept as a float32 copy for the whole step.
    ``None`` multiplies in the inputs' dtype and upcasts the logits only.
    """
    return _chunked(hidden, lm_head_weight, targets, chunk, compute_dtype, False)[0]


def chunked_token_scores(
    hidden: Tensor,
    lm_head_weight: Tensor,
    targets: Tensor,
    chunk: int = 1024,
    *,
    compute_dtype: torch.dtype | None = torch.float32,
) -> tuple[Tensor, Tensor]:
    """``chunked_token_logprobs``, and whether each target is the argmax of its logits ([B, T] bool): SFT's token
    accuracy, computed from the same chunk of logits while it exists (the ``[B, T, V]`` logits never do)."""
    return _chunked(hidden, lm_head_weight, targets, chunk, compute_dtype, True)


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
