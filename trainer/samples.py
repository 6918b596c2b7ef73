"""From rewarded groups of trajectories to padded training tensors.

The pipeline, in the order the trainer runs it::

    groups ──advantages──▶ per-trajectory advantage (or the group is dropped, with a reason)
           ──rows────────▶ token rows: input_ids, loss_mask, behaviour_logprobs, advantage
           ──truncate────▶ rows cut to max_seq_len
    rows   ──micro_batches─▶ lists of rows under a padded-token budget
           ──collate─────▶ [B, T] tensors for the model and the loss

Only token ids recorded by the gateway are ever used: nothing is re-tokenized, so the ids the
trainer scores are exactly the ids vLLM sampled (and scored with ``behaviour_logprobs``).

Alignment convention (used by ``collate`` and by ``trainer.loss``): every per-token tensor is aligned
to ``input_ids`` *as targets*. Position ``t`` of ``loss_mask`` / ``behaviour_logprobs`` / the model's
logprobs refers to token ``input_ids[t]`` predicted from ``input_ids[:t]``. So the model's logits at
position ``t - 1`` score position ``t`` (``trainer.loss.input_token_logprobs`` does that shift), and
position 0 is never trained: nothing precedes it to predict it from.

This module is pure (plain Python + torch, and the call-tree lookup it shares with the gateway,
``gateway.store.tree``, which reads no database); the store layer fills the input dataclasses.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from gateway.store.tree import Candidate, place

AdvantageMode = Literal["group", "drgrpo"]

# A group whose rewards span less than this is "zero variance": its advantages are all zero (or,
# for the std-normalised mode, noise divided by ~1e-6), so it carries no learning signal.
ZERO_VARIANCE_TOL = 1e-8
# Added to the std so a near-constant group does not blow its advantages up (docs/objectives.md §1).
STD_EPS = 1e-6


# ---------------------------------------------------------------------------------------------
# Inputs (filled by the store layer)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CallData:
    """One recorded upstream call (one choice of it when the request asked for ``n > 1``).

    ``trainable`` is the gateway's verdict (ids and logprobs present and of equal length, sampled from the
    distribution the trainer computes) and ``untrainable_reason`` its why; this module re-checks the ids, since a
    call is only worth training when its logprobs line up with them.
    """

    seq: int
    choice_index: int
    policy_version: int
    prompt_token_ids: list[int] | None
    completion_token_ids: list[int] | None
    completion_logprobs: list[float] | None
    trainable: bool
    untrainable_reason: str | None = None
    # The gateway's verdict on whether this call's prompt extends its predecessor, and why not
    # (gateway.store.lineage); None for calls recorded before it was computed.
    merge_reason: str | None = None


@dataclass(frozen=True)
class TrajectoryData:
    """A rewarded trajectory; ``calls`` are already ordered by ``(seq, choice_index)``."""

    trajectory_id: str
    reward: float
    calls: list[CallData]


@dataclass(frozen=True)
class GroupData:
    """Trajectories that answered the same task: the baseline for each other's advantages."""

    group_id: str
    trajectories: list[TrajectoryData]


# ---------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------


@dataclass
class Row:
    """One training sequence.

    ``loss_mask[t] == 1`` exactly where ``input_ids[t]`` is a completion token of a trainable call;
    ``behaviour_logprobs[t]`` is vLLM's recorded logprob of that token (0.0 wherever the mask is 0).
    ``sequence_id`` names the sequence-level ratio (GSPO) the row's tokens belong to: one per row.
    ``teacher_logprobs`` (loss ``distill`` only, ``trainer.teacher``): the teacher's logprob of every ``input_ids[t]``
    given ``input_ids[:t]``, aligned like ``behaviour_logprobs``; None until the teacher scored the row.
    """

    input_ids: list[int]
    loss_mask: list[int]
    behaviour_logprobs: list[float]
    advantage: float
    trajectory_id: str
    group_id: str
    policy_versions: tuple[int, ...] = ()
    sequence_id: int = -1
    teacher_logprobs: list[float] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def trainable_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class SampleBatch:
    """The rows of one training step plus what happened on the way (for ``train_steps.metrics``).

    ``dropped_groups`` lists ``(group_id, reason)`` for every claimed group that contributes no rows,
    so the caller can mark them dropped rather than trained. ``stats`` is JSON-serialisable.
    """

    rows: list[Row]
    stats: dict[str, Any]
    dropped_groups: list[tuple[str, str]] = field(default_factory=list)

    @property
    def trainable_tokens(self) -> int:
        """The step's global count of mask-1 tokens: the loss's ``total_tokens``."""
        return sum(row.trainable_tokens for row in self.rows)


# ---------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and *population* standard deviation (divide by n, not n − 1)."""
    n = len(values)
    if n == 0:
        return 0.0, 0.0
    mean = sum(values) / n
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / n)


def is_zero_variance(rewards: Sequence[float]) -> bool:
    """True when every reward is the same (a group of one always is): no relative signal."""
    return len(rewards) == 0 or max(rewards) - min(rewards) < ZERO_VARIANCE_TOL


def group_advantages(rewards: Sequence[float], mode: AdvantageMode = "group") -> list[float]:
    """Advantages of one group's trajectories.

    - ``"group"`` (GRPO/DAPO): ``(r − mean) / (std + 1e-6)`` with the **population** std. The group
      is the whole population being normalised, not a sample of a larger one, so the z-scores have
      exactly unit variance (Σ A² = n) whatever the group size; groups closed early with fewer
      trajectories keep the same advantage scale. TRL and verl use ``torch.std`` (Bessel-corrected,
      n − 1), which makes their advantages smaller by sqrt((n − 1)/n) — 0.935 for n = 8 — a constant
      the learning rate absorbs.
    - ``"drgrpo"`` (Dr. GRPO): ``r − mean``; no std division, which would up-weight groups that are
      nearly all right or all wrong.
    """
    mean, std = _mean_std(rewards)
    if mode == "group":
        return [(r - mean) / (std + STD_EPS) for r in rewards]
    if mode == "drgrpo":
        return [r - mean for r in rewards]
    raise ValueError(f"unknown advantage mode {mode!r} (expected 'group' or 'drgrpo')")


@dataclass(frozen=True)
class SftSelection:
    """Which trajectories of a group SFT trains (docs/objectives.md §9): exactly one rule.

    - ``min_reward``: every trajectory whose reward is at least this;
    - ``best_k``: the ``k`` best of each group (rejection-sampling fine-tuning), all of a group smaller than ``k``.
    """

    min_reward: float | None = None
    best_k: int | None = None

    def __post_init__(self) -> None:
        if (self.min_reward is None) == (self.best_k is None):
            raise ValueError("an SFT selection is min_reward or best_k, exactly one")
        if self.best_k is not None and self.best_k < 1:
            raise ValueError("best_k must be at least 1")


def select_trajectories(rewards: Sequence[float], selection: SftSelection) -> list[bool]:
    """Which of a group's trajectories (in the group's order) SFT trains.

    Best-k ties: trajectories of equal reward keep the group's order (the store loads them by when they were
    recorded), so a tie at the k-th place goes to the earlier ones and exactly ``min(k, G)`` are selected: the
    step's size does not depend on how many happened to tie.
    """
    if selection.min_reward is not None:
        return [r >= selection.min_reward for r in rewards]
    assert selection.best_k is not None  # __post_init__: one rule is set
    # sorted is stable: among equal rewards the earlier trajectory ranks first.
    best = sorted(range(len(rewards)), key=lambda i: -rewards[i])[: selection.best_k]
    chosen = set(best)
    return [i in chosen for i in range(len(rewards))]


# ---------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------


def call_is_trainable(call: CallData) -> bool:
    """Whether a call's completion can carry loss: flagged trainable by the gateway, with a
    non-empty completion and one finite logprob per completion id (a NaN or ±inf behaviour
    logprob would make the importance ratio meaningless)."""
    ids, logprobs = call.completion_token_ids, call.completion_logprobs
    return (
        call.trainable
        and call.prompt_token_ids is not None
        and ids is not None
        and logprobs is not None
        and len(ids) > 0
        and len(ids) == len(logprobs)
        and all(math.isfinite(lp) for lp in logprobs)
    )


@dataclass
class _RowBuilder:
    """A row being assembled from one or more calls of a trajectory."""

    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    behaviour_logprobs: list[float] = field(default_factory=list)
    policy_versions: set[int] = field(default_factory=set)

    def append_context(self, ids: Sequence[int]) -> None:
        """Tokens the model reads but is not trained on (prompts, tool results, new user turns)."""
        self.input_ids.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.behaviour_logprobs.extend([0.0] * len(ids))

    def append_call(self, call: CallData, trainable: bool) -> None:
        """Append ``call``'s prompt tokens beyond what the row holds (mask 0), then its completion:
        mask 1 with vLLM's logprobs if trainable, else mask 0 (context only)."""
        prompt = call.prompt_token_ids or []
        completion = call.completion_token_ids or []
        self.append_context(prompt[len(self.input_ids) :])
        if trainable:
            start = len(self.input_ids)
            self.input_ids.extend(completion)
            self.loss_mask.extend([1] * len(completion))
            self.behaviour_logprobs.extend(float(lp) for lp in call.completion_logprobs or [])
            if start == 0:
                # Empty prompt: the first token has no context to be predicted from (see the module
                # docstring's alignment convention), so it cannot be trained.
                self.loss_mask[0] = 0
                self.behaviour_logprobs[0] = 0.0
        else:
            self.append_context(completion)
        self.policy_versions.add(call.policy_version)


@dataclass
class _Counters:
    calls: int = 0
    untrainable_calls: int = 0
    untrainable_reasons: dict[str, int] = field(default_factory=dict)
    calls_without_ids: int = 0
    merge_candidates: int = 0
    merged_calls: int = 0
    merge_breaks: dict[str, int] = field(default_factory=dict)
    roots: int = 0
    forks: int = 0
    shared_prefix_tokens: int = 0


def _break_reason(call: CallData, parent: CallData | None) -> str:
    """Why a merge candidate starts a new row: `branched` when it extends a call whose row another call already
    continued (a parallel branch, a repeated or edited turn, another choice: each a path of its own), else the
    gateway's recorded reason (`unknown` when it predates its recording)."""
    if parent is not None:
        return "branched"
    if call.merge_reason is None:
        return "unknown"
    return call.merge_reason


class _Tree:
    """The trajectory's calls seen so far, as parents for the next: the parent of a call is the earlier call whose
    prompt + completion ids its prompt starts with, the longest, the lowest (seq, choice_index) on a tie. That is the
    parent the gateway records (gateway.store.tree.place, used here too, so both agree), found from the ids alone with
    the same cost: one hash pass over the call's own ids, one digest per earlier call."""

    def __init__(self) -> None:
        self._candidates: list[Candidate] = []
        self._calls: dict[tuple[int, int], CallData] = {}

    def place(self, call: CallData) -> CallData | None:
        earlier = (c for c in self._candidates if c.seq < call.seq)  # choices of one call are siblings
        parent, own = place(call.prompt_token_ids, call.completion_token_ids, earlier)
        if own is not None:
            self._candidates.append(Candidate(call.seq, call.choice_index, *own))
            self._calls[(call.seq, call.choice_index)] = call
        return None if parent is None else self._calls[(parent.seq, parent.choice_index)]


def _trajectory_rows(traj: TrajectoryData, counters: _Counters) -> list[_RowBuilder]:
    """One row per root-to-leaf path of the trajectory's call tree, each token trained in one row only.

    A trajectory is a tree of calls (docs/design.md §7, gateway/store/tree.py): a call's parent is the earlier call whose
    prompt + completion its prompt starts with exactly, the longest one; a call extending none is a root. Walking the
    calls in (seq, choice) order, a call whose parent ends a row (the parent's first child) joins that row: the prompt
    tokens past the parent (tool results, a new user turn, the template's glue) enter with mask 0, then its
    completion with mask 1. Any other call opens a row of its own with its full prompt at mask 0: a root, or a fork
    (its parent already has a child: parallel branches, a retried turn, another choice of an ``n > 1`` call), whose
    row repeats the path up to the parent as context only, so no token is trained twice. Arrival order does not
    matter: a supervisor resuming after a sub-agent continues its own row.

    A call without ids (an upstream error, a failed capture) is nobody's parent; the calls after it still find
    theirs by content. Untrainable calls that do have ids stay in as context (mask 0).
    """
    rows: list[_RowBuilder] = []
    tips: dict[int, _RowBuilder] = {}  # id(parent call) -> the row it ends, while no other call continued it
    tree = _Tree()
    seen_choice0 = False
    for call in traj.calls:
        counters.calls += 1
        trainable = call_is_trainable(call)
        if not trainable:
            counters.untrainable_calls += 1
            why = call.untrainable_reason or ("invalid ids or logprobs" if call.trainable else "no reason recorded")
            counters.untrainable_reasons[why] = counters.untrainable_reasons.get(why, 0) + 1
        if call.prompt_token_ids is None or call.completion_token_ids is None:
            counters.calls_without_ids += 1
            continue

        candidate = call.choice_index == 0 and seen_choice0
        if call.choice_index == 0:
            seen_choice0 = True
        if candidate:
            counters.merge_candidates += 1
        parent = tree.place(call)
        target = tips.pop(id(parent), None) if parent is not None else None
        if target is not None:
            if candidate:
                counters.merged_calls += 1
        else:
            if candidate:
                why = _break_reason(call, parent)
                counters.merge_breaks[why] = counters.merge_breaks.get(why, 0) + 1
            if parent is None:
                counters.roots += 1
            else:
                counters.forks += 1
                counters.shared_prefix_tokens += len(parent.prompt_token_ids or []) + len(
                    parent.completion_token_ids or []
                )
            target = _RowBuilder()
            rows.append(target)
        target.append_call(call, trainable)
        tips[id(call)] = target
    return rows


def tokens_trained_twice(rows: Sequence[Row]) -> int:
    """Trained positions (mask 1) whose token and whole context equal a trained position of another row of the same
    trajectory: the cost of a layout that trains a shared prefix in every path. The tree layout's goal is 0; two
    calls that sampled the very same ids from the very same context are two samples, and would count here."""
    seen: set[tuple[str, int, int]] = set()
    twice = 0
    for row in rows:
        prefix = 0
        for position, (token, mask) in enumerate(zip(row.input_ids, row.loss_mask, strict=True)):
            prefix = (prefix * _HASH_BASE + token + 1) % _HASH_MOD
            if mask:
                key = (row.trajectory_id, position, prefix)
                if key in seen:
                    twice += 1
                seen.add(key)
    return twice


# A polynomial hash of each row prefix (tokens_trained_twice): one pass over the tokens, no list copies.
_HASH_BASE = 1_000_003
_HASH_MOD = (1 << 61) - 1


def _truncate(row: Row, max_seq_len: int) -> int:
    """Cut ``row`` to its first ``max_seq_len`` tokens; return how many were removed.

    We keep the beginning: a token's logprob depends on everything before it, so dropping the start
    would change the context the recorded behaviour logprobs were computed under and bias the ratio.
    Dropping the end only loses those tokens' training signal.
    """
    cut = len(row.input_ids) - max_seq_len
    if cut <= 0:
        return 0
    del row.input_ids[max_seq_len:]
    del row.loss_mask[max_seq_len:]
    del row.behaviour_logprobs[max_seq_len:]
    return cut


def build_samples(
    groups: Iterable[GroupData],
    *,
    advantage_mode: AdvantageMode = "group",
    drop_zero_variance: bool = True,
    max_seq_len: int | None = None,
    current_policy_version: int | None = None,
    max_staleness: int | None = None,
    sft: SftSelection | None = None,
) -> SampleBatch:
    """Turn claimed, rewarded groups into training rows.

    Per group: compute advantages (or drop it, with a reason), then rows per trajectory (see
    ``_trajectory_rows``), each row carrying its trajectory's advantage. With ``sft`` (loss ``sft``) the
    group's selected trajectories (``select_trajectories``) are its rows instead, with advantage 0 (the
    cross-entropy uses none); the others are consumed with the group, untrained. There is no zero-variance
    filter (a group that is all right is what SFT wants most), and a group with no trajectory selected is
    dropped with the reason ``no trajectory selected``. Rows are cut to
    ``max_seq_len``; a row left with no trainable token is dropped, and a group left with no row is
    reported dropped (never a silent no-op). ``sequence_id`` is the row's index in the result.

    Staleness (docs/objectives.md §5) is checked only when both ``current_policy_version`` and ``max_staleness``
    are given: a group with any call served by a policy older than ``current − max_staleness`` is
    dropped.

    Stats, all JSON-serialisable:

    - ``groups_used``, ``groups_dropped`` (count), ``drop_reasons`` ({reason: count}); the
      ``(group_id, reason)`` pairs are ``SampleBatch.dropped_groups``.
    - ``trajectories`` (all claimed), ``trajectories_used`` (those of the used groups); with ``sft``,
      ``trajectories_selected`` (those the selection chose in the used groups).
    - Call-level stats are over **all claimed groups**, dropped ones included (they describe the
      traffic, not the filters): ``calls`` (every choice counts), ``untrainable_calls`` (any call
      not fit to train: context-only or without ids), ``untrainable_reasons`` ({the gateway's reason: count},
      e.g. calls sampled at another temperature than the one trained), ``calls_without_ids`` (the subset that broke a
      row), ``merged_calls``, ``merge_candidates``, ``merge_ratio``: a *merge candidate* is a choice-0
      call with token ids that has an earlier choice-0 call with ids in the same trajectory, i.e. a
      turn that could have continued an earlier row. ``merge_ratio = merged_calls /
      max(1, merge_candidates)``: 1.0 means every multi-turn trajectory became a single row; 0.0
      means every turn is its own row. A row broken by a call without ids counts against it.
      ``merge_breaks`` ({reason: count}, summing to ``merge_candidates - merged_calls``): why each
      candidate that did not merge started a new row — ``branched`` when the call extends a call whose
      row another call already continued, else the gateway's recorded ``merge_reason``
      (gateway.store.lineage: ``new_root``, ``compacted``...), ``unknown`` for calls recorded before the
      reason was.
    - The call tree (see ``_trajectory_rows``), over all claimed groups: ``roots`` (calls with ids that
      extend no earlier call: each trajectory's first, sub-agents, compacted histories), ``forks`` (calls
      extending a call another call already continued: each opens a row whose path up to the parent is
      context only), ``shared_prefix_tokens`` (those paths' tokens, re-encoded but not trained). Over the
      rows kept: ``rows_per_trajectory`` (per trajectory with a row) and ``tokens_trained_twice`` (goal 0,
      see ``tokens_trained_twice``).
    - ``rows``, ``tokens`` (all row tokens after truncation), ``trainable_tokens`` (mask 1 — the
      loss's ``total_tokens``), ``truncated_rows``, ``truncated_tokens`` (tokens cut off),
      ``truncated_rows_dropped``, ``empty_rows_dropped`` (rows that never had a trainable token:
      context only) — all over the used groups' rows.
    - ``reward_mean`` / ``reward_std``: over **every claimed trajectory**, dropped groups included —
      the policy's reward on what it sampled, the curve to watch; dropping all-correct groups would
      bias it. ``used_reward_mean`` / ``used_reward_std``: over the trajectories of used groups only
      (with ``sft``, the selected ones only), what the update actually learned from. Both population std.
    - ``policy_version_min`` / ``policy_version_max``: over the rows' calls (None without rows).
    - ``staleness_mean`` / ``staleness_max``: over the used groups, ``current_policy_version`` minus the oldest
      version that served a call of the group (None without ``current_policy_version`` or used groups).
    """
    if max_seq_len is not None and max_seq_len < 2:
        raise ValueError("max_seq_len must be at least 2 (position 0 is never trained)")
    check_staleness = current_policy_version is not None and max_staleness is not None

    all_rewards: list[float] = []
    used_rewards: list[float] = []
    dropped: list[tuple[str, str]] = []
    counters = _Counters()
    rows: list[Row] = []
    trajectories = trajectories_used = groups_used = 0
    truncated_rows = truncated_tokens = truncated_rows_dropped = empty_rows_dropped = 0
    staleness: list[int] = []
    selected_count = 0

    for group in groups:
        rewards = [float(t.reward) for t in group.trajectories]
        trajectories += len(rewards)
        all_rewards.extend(r for r in rewards if math.isfinite(r))
        # Rows are built for every group, used or not, so the call-level stats (merge ratio,
        # untrainable calls) describe all the traffic claimed, not only what survived the filters.
        built_rows = [(traj, _trajectory_rows(traj, counters)) for traj in group.trajectories]

        if not group.trajectories:
            dropped.append((group.group_id, "empty group"))
            continue
        if not all(math.isfinite(r) for r in rewards):
            dropped.append((group.group_id, "non-finite reward"))
            continue
        if check_staleness:
            oldest = min((c.policy_version for t in group.trajectories for c in t.calls), default=None)
            if oldest is not None and oldest < current_policy_version - max_staleness:  # type: ignore[operator]
                dropped.append((group.group_id, "stale policy"))
                continue
        if sft is not None:
            selected = select_trajectories(rewards, sft)
            if not any(selected):
                dropped.append((group.group_id, "no trajectory selected"))
                continue
            advantages = [0.0] * len(rewards)
        else:
            if drop_zero_variance and is_zero_variance(rewards):
                dropped.append((group.group_id, "zero reward variance"))
                continue
            selected = [True] * len(rewards)
            advantages = group_advantages(rewards, advantage_mode)

        group_rows: list[Row] = []
        cut_rows = cut_tokens = cut_dropped = empty = 0
        for (traj, built), adv, chosen in zip(built_rows, advantages, selected, strict=True):
            if not chosen:
                continue
            for b in built:
                row = Row(
                    input_ids=b.input_ids,
                    loss_mask=b.loss_mask,
                    behaviour_logprobs=b.behaviour_logprobs,
                    advantage=adv,
                    trajectory_id=traj.trajectory_id,
                    group_id=group.group_id,
                    policy_versions=tuple(sorted(b.policy_versions)),
                )
                if row.trainable_tokens == 0:
                    empty += 1
                    continue
                cut = _truncate(row, max_seq_len) if max_seq_len is not None else 0
                if cut:
                    cut_rows += 1
                    cut_tokens += cut
                    if row.trainable_tokens == 0:
                        cut_dropped += 1
                        continue
                group_rows.append(row)

        if not group_rows:
            dropped.append((group.group_id, "no trainable tokens"))
            continue
        groups_used += 1
        trajectories_used += len(rewards)
        if current_policy_version is not None:
            staleness.append(current_policy_version - min(c.policy_version for t in group.trajectories for c in t.calls))
        used_rewards.extend(r for r, chosen in zip(rewards, selected, strict=True) if chosen)
        selected_count += sum(selected)
        rows.extend(group_rows)
        truncated_rows += cut_rows
        truncated_tokens += cut_tokens
        truncated_rows_dropped += cut_dropped
        empty_rows_dropped += empty

    for i, row in enumerate(rows):
        row.sequence_id = i

    reward_mean, reward_std = _mean_std(all_rewards)
    used_mean, used_std = _mean_std(used_rewards)
    versions = [v for row in rows for v in row.policy_versions]
    drop_reasons: dict[str, int] = {}
    for _, reason in dropped:
        drop_reasons[reason] = drop_reasons.get(reason, 0) + 1
    stats: dict[str, Any] = {
        "groups_used": groups_used,
        "groups_dropped": len(dropped),
        "drop_reasons": drop_reasons,
        "trajectories": trajectories,
        "trajectories_used": trajectories_used,
        "calls": counters.calls,
        "merged_calls": counters.merged_calls,
        "merge_candidates": counters.merge_candidates,
        "merge_ratio": counters.merged_calls / max(1, counters.merge_candidates),
        "merge_breaks": counters.merge_breaks,
        "roots": counters.roots,
        "forks": counters.forks,
        "shared_prefix_tokens": counters.shared_prefix_tokens,
        "rows_per_trajectory": len(rows) / max(1, len({row.trajectory_id for row in rows})),
        "tokens_trained_twice": tokens_trained_twice(rows),
        "rows": len(rows),
        "tokens": sum(len(row) for row in rows),
        "trainable_tokens": sum(row.trainable_tokens for row in rows),
        "untrainable_calls": counters.untrainable_calls,
        "untrainable_reasons": counters.untrainable_reasons,
        "calls_without_ids": counters.calls_without_ids,
        "truncated_rows": truncated_rows,
        "truncated_tokens": truncated_tokens,
        "truncated_rows_dropped": truncated_rows_dropped,
        "empty_rows_dropped": empty_rows_dropped,
        "reward_mean": reward_mean,
        "reward_std": reward_std,
        "used_reward_mean": used_mean,
        "used_reward_std": used_std,
        "policy_version_min": min(versions) if versions else None,
        "policy_version_max": max(versions) if versions else None,
        "staleness_mean": sum(staleness) / len(staleness) if staleness else None,
        "staleness_max": max(staleness) if staleness else None,
    }
    if sft is not None:
        stats["trajectories_selected"] = selected_count
    return SampleBatch(rows=rows, stats=stats, dropped_groups=dropped)


# ---------------------------------------------------------------------------------------------
# Batching
# ---------------------------------------------------------------------------------------------


def padded_length(length: int, pad_to_multiple_of: int | None = None) -> int:
    """The length a row of ``length`` tokens is padded to."""
    if pad_to_multiple_of:
        return -(-length // pad_to_multiple_of) * pad_to_multiple_of
    return length


def micro_batches(
    rows: Sequence[Row], micro_batch_tokens: int, *, pad_to_multiple_of: int | None = None
) -> list[list[Row]]:
    """Split rows into micro-batches whose *padded* size ``B × T`` stays within ``micro_batch_tokens``.

    Rows are sorted longest first, so each micro-batch holds rows of similar length (little padding)
    and the largest, most memory-hungry micro-batch runs first: an out-of-memory shows up on the first
    forward, not at the end of a step. A row longer than the budget on its own gets a micro-batch of
    one (rows are never split: keep ``max_seq_len ≤ micro_batch_tokens``). Because the loss is
    normalised by the step's global token count, how rows are grouped does not change the gradient.
    """
    if micro_batch_tokens <= 0:
        raise ValueError("micro_batch_tokens must be positive")
    batches: list[list[Row]] = []
    current: list[Row] = []
    for row in sorted(rows, key=len, reverse=True):
        if current and (len(current) + 1) * padded_length(len(current[0]), pad_to_multiple_of) > micro_batch_tokens:
            batches.append(current)
            current = []
        current.append(row)
    if current:
        batches.append(current)
    return batches


def collate(rows: Sequence[Row], pad_id: int = 0, *, pad_to_multiple_of: int | None = None) -> dict[str, torch.Tensor]:
    """Right-pad rows into tensors (see the module docstring for the alignment convention).

    Returns:
        ``input_ids`` [B, T] long (``pad_id`` past each row's end), ``attention_mask`` [B, T] long
        (1 on real tokens), ``loss_mask`` [B, T] float32 (1 where ``input_ids[b, t]`` is a trained
        target), ``behaviour_logprobs`` [B, T] float32 (vLLM's logprob of ``input_ids[b, t]``, 0
        elsewhere), ``advantages`` [B] float32, ``sequence_ids`` [B] long, ``lengths`` [B] long; and
        ``teacher_logprobs`` [B, T] float32 when every row has them (0 past each row's end).
        Padding never carries loss, so a padded ``pad_id`` that is a real vocabulary id is harmless.
    """
    if not rows:
        raise ValueError("collate needs at least one row")
    B = len(rows)
    T = padded_length(max(len(row) for row in rows), pad_to_multiple_of)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    loss_mask = torch.zeros((B, T), dtype=torch.float32)
    behaviour_logprobs = torch.zeros((B, T), dtype=torch.float32)
    for b, row in enumerate(rows):
        n = len(row)
        input_ids[b, :n] = torch.tensor(row.input_ids, dtype=torch.long)
        attention_mask[b, :n] = 1
        loss_mask[b, :n] = torch.tensor(row.loss_mask, dtype=torch.float32)
        behaviour_logprobs[b, :n] = torch.tensor(row.behaviour_logprobs, dtype=torch.float32)
    out = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "behaviour_logprobs": behaviour_logprobs,
        "advantages": torch.tensor([row.advantage for row in rows], dtype=torch.float32),
        "sequence_ids": torch.tensor([row.sequence_id for row in rows], dtype=torch.long),
        "lengths": torch.tensor([len(row) for row in rows], dtype=torch.long),
    }
    if all(row.teacher_logprobs is not None for row in rows):
        teacher = torch.zeros((B, T), dtype=torch.float32)
        for b, row in enumerate(rows):
            assert row.teacher_logprobs is not None
            if len(row.teacher_logprobs) != len(row):
                raise ValueError(f"a row of {len(row)} tokens has {len(row.teacher_logprobs)} teacher logprobs")
            teacher[b, : len(row)] = torch.tensor(row.teacher_logprobs, dtype=torch.float32)
        out["teacher_logprobs"] = teacher
    return out
