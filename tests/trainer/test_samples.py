"""From rewarded groups to rows and tensors: hand-made trajectories with hand-computed expectations."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.support.training_data import call, group, traj
from trainer.loss import LossConfig, policy_loss
from trainer.samples import (
    CallData,
    GroupData,
    Row,
    TrajectoryData,
    build_samples,
    collate,
    group_advantages,
    micro_batches,
    tokens_trained_twice,
)


def with_partner(t: TrajectoryData, reward: float = 0.0) -> GroupData:
    """A group of ``t`` plus a one-call partner with a different reward, so it is not zero-variance."""
    return group("g", t, traj("partner", reward, call([50, 51], [52], [-1.0])))


def rows_of(batch, tid):
    return [r for r in batch.rows if r.trajectory_id == tid]


# ----------------------------------------------------------------------------------- merging


def test_exact_prefix_merges_into_one_row() -> None:
    t = traj(
        "t",
        1.0,
        call([1, 2, 3], [4, 5], [-0.1, -0.2], seq=0, version=3),
        call([1, 2, 3, 4, 5, 6, 7], [8, 9], [-0.3, -0.4], seq=1, version=4),
    )
    batch = build_samples([with_partner(t)])
    (row,) = rows_of(batch, "t")
    assert row.input_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert row.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 1]  # tool result / user turn 6, 7 are context
    assert row.behaviour_logprobs == [0, 0, 0, -0.1, -0.2, 0, 0, -0.3, -0.4]
    assert row.policy_versions == (3, 4)
    assert batch.stats["merged_calls"] == 1 and batch.stats["merge_ratio"] == 1.0


def test_prompt_equal_to_row_merges_with_no_context_tokens() -> None:
    t = traj("t", 1.0, call([1, 2], [3]), call([1, 2, 3], [4], seq=1))
    (row,) = rows_of(build_samples([with_partner(t)]), "t")
    assert row.input_ids == [1, 2, 3, 4] and row.loss_mask == [0, 0, 1, 1]


def test_mismatch_starts_a_new_row_with_the_same_advantage() -> None:
    # The template re-rendered the assistant turn (4, 5 → 4, 99): not a prefix, so a separate row.
    t = traj("t", 1.0, call([1, 2, 3], [4, 5], seq=0), call([1, 2, 3, 4, 99, 6], [7], [-0.5], seq=1))
    batch = build_samples([with_partner(t)])
    first, second = rows_of(batch, "t")
    assert first.input_ids == [1, 2, 3, 4, 5] and first.loss_mask == [0, 0, 0, 1, 1]
    assert second.input_ids == [1, 2, 3, 4, 99, 6, 7] and second.loss_mask == [0, 0, 0, 0, 0, 0, 1]
    assert second.behaviour_logprobs == [0, 0, 0, 0, 0, 0, -0.5]
    assert first.advantage == second.advantage == pytest.approx(1.0, abs=1e-5)
    assert first.sequence_id != second.sequence_id  # GSPO: one ratio per row
    assert batch.stats["merge_ratio"] == 0.0


def test_a_prompt_shorter_than_the_row_does_not_merge() -> None:
    t = traj("t", 1.0, call([1, 2, 3], [4, 5]), call([1, 2, 3, 4], [6], seq=1))
    assert len(rows_of(build_samples([with_partner(t)]), "t")) == 2


def test_merge_breaks_count_the_recorded_reason_of_each_new_row() -> None:
    def why(c: CallData, reason: str | None) -> CallData:
        return CallData(*[getattr(c, f) for f in ("seq", "choice_index", "policy_version", "prompt_token_ids",
                          "completion_token_ids", "completion_logprobs", "trainable")], merge_reason=reason)

    t = traj(
        "t",
        1.0,
        why(call([1], [2], seq=0), "first_call"),
        why(call([1, 2, 3], [4], seq=1), "extends"),  # merges
        why(call([1, 2, 5], [6], seq=2), "extends"),  # extends seq 0, whose row seq 1 continued: branched
        why(call([1, 9], [6], seq=3), "history_edited"),  # extends nothing: a root, with the gateway's reason
        call(None, None, seq=4),  # no ids: nobody's parent
        why(call([1, 9, 6, 7], [8], seq=5), "extends"),  # continues seq 3's row by content
        why(call([3, 3], [8], seq=6), "new_root"),
        call([0], [8], seq=7),  # recorded before reasons were
    )
    s = build_samples([with_partner(t)]).stats
    assert s["merge_breaks"] == {"branched": 1, "history_edited": 1, "new_root": 1, "unknown": 1}
    assert sum(s["merge_breaks"].values()) == s["merge_candidates"] - s["merged_calls"]
    assert (s["roots"], s["forks"]) == (4 + 1, 1)  # the partner's one call is a root too


def test_merge_ratio_on_a_hand_made_case() -> None:
    a = traj(
        "a",
        1.0,
        call([1], [2], seq=0),
        call([1, 2, 3], [4], seq=1),  # merges (candidate 1)
        call([9, 9], [5], seq=2),  # does not (candidate 2)
        call([9, 9, 5, 6], [7], seq=3),  # merges into the new row (candidate 3)
    )
    b = traj(
        "b",
        0.0,
        call([1], [2], seq=0, choice=0),
        call([1], [3], seq=0, choice=1),  # n > 1: never a candidate
        call([1, 2, 8], [4], seq=1),  # merges into choice 0's row (candidate 4)
    )
    c = traj("c", 0.5, call([7], [8]))  # single call: no candidate
    batch = build_samples([group("g", a, b, c)])
    s = batch.stats
    assert (s["merged_calls"], s["merge_candidates"]) == (3, 4)
    assert s["merge_ratio"] == pytest.approx(3 / 4)
    assert s["calls"] == 8 and s["rows"] == 5
    assert [r.input_ids for r in rows_of(batch, "a")] == [[1, 2, 3, 4], [9, 9, 5, 6, 7]]


def test_n_choices_become_separate_rows_and_a_later_call_continues_the_one_it_extends() -> None:
    t = traj(
        "t",
        1.0,
        call([1, 2], [3, 4], seq=0, choice=0),
        call([1, 2], [5], [-0.7], seq=0, choice=1),
        call([1, 2, 5, 6], [7], seq=1),  # continues choice 1: joins its row
        call([1, 2, 5, 6, 7, 8], [9], seq=2),  # continues the previous call: merged
    )
    batch = build_samples([with_partner(t)])
    rows = rows_of(batch, "t")
    assert [r.input_ids for r in rows] == [[1, 2, 3, 4], [1, 2, 5, 6, 7, 8, 9]]
    assert rows[1].loss_mask == [0, 0, 1, 0, 1, 0, 1] and rows[1].behaviour_logprobs[:3] == [0, 0, -0.7]
    assert len({r.advantage for r in rows}) == 1
    assert batch.stats["merged_calls"] == 2 and batch.stats["merge_candidates"] == 2


def _extending(c: CallData) -> CallData:
    """The call as a token_in gateway records it: it extends the turn it names (gateway.store.lineage)."""
    return dataclasses.replace(c, merge_reason="extends")


def test_a_parallel_branch_joins_the_row_of_the_turn_it_continues() -> None:
    t = traj(
        "t",
        1.0,
        call([1, 2], [3], seq=0),
        _extending(call([1, 2, 3, 4], [5], seq=1)),
        _extending(call([1, 2, 3, 4], [6], seq=2)),  # the same turn again: a sibling of seq 1, a row of its own
        _extending(call([1, 2, 3, 4, 5, 7], [8], seq=3)),  # goes on from seq 1, not from the repeat
        _extending(call([1, 2, 3, 4, 6, 7], [9], seq=4)),  # and this one from the repeat
    )
    batch = build_samples([with_partner(t)])
    assert [r.input_ids for r in rows_of(batch, "t")] == [[1, 2, 3, 4, 5, 7, 8], [1, 2, 3, 4, 6, 7, 9]]
    s = batch.stats
    assert (s["merged_calls"], s["merge_candidates"], s["merge_breaks"]) == (3, 4, {"branched": 1})


# ---------------------------------------------------------------------------- trainability


def test_masks_only_on_completion_tokens() -> None:
    t = traj("t", 1.0, call([10, 11, 12], [13, 14, 15]), call([10, 11, 12, 13, 14, 15, 16, 17], [18], seq=1))
    (row,) = rows_of(build_samples([with_partner(t)]), "t")
    completion_tokens = {13, 14, 15, 18}
    for token, m, lp in zip(row.input_ids, row.loss_mask, row.behaviour_logprobs, strict=True):
        assert m == (token in completion_tokens)
        assert (lp != 0) == (token in completion_tokens)


@pytest.mark.parametrize(
    "bad",
    [
        dict(trainable=False),
        dict(logprobs=[-0.1]),  # one logprob for two ids
        dict(logprobs=[-0.1, float("nan")]),
        dict(logprobs=[-0.1, float("-inf")]),
    ],
    ids=["flagged", "length-mismatch", "nan", "-inf"],
)
def test_untrainable_calls_are_context_only(bad) -> None:
    t = traj(
        "t",
        1.0,
        call([1, 2], [3], [-0.3], seq=0),
        call([1, 2, 3, 4], [5, 6], seq=1, **bad),
        call([1, 2, 3, 4, 5, 6, 7], [8], [-0.8], seq=2),
    )
    batch = build_samples([with_partner(t)])
    (row,) = rows_of(batch, "t")
    assert row.input_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert row.loss_mask == [0, 0, 1, 0, 0, 0, 0, 1]
    assert row.behaviour_logprobs == [0, 0, -0.3, 0, 0, 0, 0, -0.8]
    assert batch.stats["untrainable_calls"] == 1
    assert batch.stats["merged_calls"] == 2


def test_an_untrainable_first_call_is_context_for_the_next() -> None:
    t = traj("t", 1.0, call([1], [2, 3], trainable=False), call([1, 2, 3, 4], [5], [-0.5], seq=1))
    (row,) = rows_of(build_samples([with_partner(t)]), "t")
    assert row.input_ids == [1, 2, 3, 4, 5] and row.loss_mask == [0, 0, 0, 0, 1]


def test_a_call_without_ids_is_nobodys_parent_and_the_next_call_continues_by_content() -> None:
    t = traj(
        "t",
        1.0,
        call([1, 2], [3], seq=0),
        CallData(1, 0, 0, None, None, None, False),  # an upstream error: nothing recorded
        call([1, 2, 3, 4], [5], seq=2),  # the agent's retry extends seq 0
    )
    batch = build_samples([with_partner(t)])
    assert [r.input_ids for r in rows_of(batch, "t")] == [[1, 2, 3, 4, 5]]
    s = batch.stats
    assert s["calls_without_ids"] == 1 and s["untrainable_calls"] == 1
    assert (s["merged_calls"], s["merge_candidates"]) == (1, 1)


def test_context_only_rows_are_dropped_and_a_group_without_tokens_is_reported() -> None:
    g = group(
        "dead",
        traj("a", 1.0, call([1], [2], trainable=False)),
        traj("b", 0.0, call([1], [3], trainable=False)),
    )
    batch = build_samples([g])
    assert batch.rows == []
    assert batch.dropped_groups == [("dead", "no trainable tokens")]
    assert batch.stats["empty_rows_dropped"] == 0  # counted only for used groups
    assert batch.stats["untrainable_calls"] == 2  # call stats cover every claimed group


def test_empty_prompt_never_trains_position_zero() -> None:
    t = traj("t", 1.0, call([], [7, 8], [-0.7, -0.8]))
    (row,) = rows_of(build_samples([with_partner(t)]), "t")
    assert row.input_ids == [7, 8] and row.loss_mask == [0, 1] and row.behaviour_logprobs == [0.0, -0.8]


# ------------------------------------------------------------------------------- truncation


def test_truncation_keeps_the_beginning_and_counts() -> None:
    long = traj("long", 1.0, call([1, 2, 3, 4], [5, 6, 7, 8, 9, 10], [-0.5, -0.6, -0.7, -0.8, -0.9, -1.0]))
    gone = traj("gone", 0.0, call([1, 2, 3, 4, 5, 6, 7], [8, 9], [-0.8, -0.9]))  # completion past the cut
    short = traj("short", 0.5, call([1], [2], [-0.2]))
    batch = build_samples([group("g", long, gone, short)], max_seq_len=6)
    (row,) = rows_of(batch, "long")
    assert row.input_ids == [1, 2, 3, 4, 5, 6]
    assert row.loss_mask == [0, 0, 0, 0, 1, 1]
    assert row.behaviour_logprobs == [0, 0, 0, 0, -0.5, -0.6]
    assert rows_of(batch, "gone") == []
    s = batch.stats
    assert s["truncated_rows"] == 2
    assert s["truncated_tokens"] == 4 + 3
    assert s["truncated_rows_dropped"] == 1
    assert s["rows"] == 2 and s["tokens"] == 6 + 2 and s["trainable_tokens"] == 2 + 1
    assert batch.trainable_tokens == 3


# ------------------------------------------------------------------------------- advantages


def test_group_advantages_use_the_population_std() -> None:
    # rewards 0, 1, 2: mean 1, population std sqrt(2/3)
    std = math.sqrt(2 / 3)
    assert group_advantages([0.0, 1.0, 2.0], "group") == pytest.approx([-1 / (std + 1e-6), 0.0, 1 / (std + 1e-6)])
    assert group_advantages([0.0, 1.0, 2.0], "drgrpo") == pytest.approx([-1.0, 0.0, 1.0])
    # rewards 1, 0, 0, 1: mean 0.5, population std 0.5 (the sample std would be 0.577)
    a = 0.5 / (0.5 + 1e-6)
    assert group_advantages([1.0, 0.0, 0.0, 1.0], "group") == pytest.approx([a, -a, -a, a])
    with pytest.raises(ValueError):
        group_advantages([1.0], "ppo")  # type: ignore[arg-type]


@pytest.mark.parametrize("mode, expected", [("group", [1 / 1.000001, -1 / 1.000001]), ("drgrpo", [1.0, -1.0])])
def test_rows_carry_their_trajectory_advantage(mode, expected) -> None:
    g = group("g", traj("a", 3.0, call([1], [2])), traj("b", 1.0, call([1], [3])))
    batch = build_samples([g], advantage_mode=mode)
    assert [r.advantage for r in batch.rows] == pytest.approx(expected)


def test_zero_variance_groups_are_dropped_with_a_reason() -> None:
    same = group("same", traj("a", 1.0, call([1], [2])), traj("b", 1.0 + 1e-9, call([1], [3])))
    single = group("single", traj("c", 0.3, call([1], [2])))
    good = group("good", traj("d", 1.0, call([1], [2])), traj("e", 0.0, call([1], [3])))
    empty = group("empty")
    batch = build_samples([same, single, good, empty])
    assert batch.dropped_groups == [
        ("same", "zero reward variance"),
        ("single", "zero reward variance"),
        ("empty", "empty group"),
    ]
    assert batch.stats["groups_used"] == 1 and batch.stats["groups_dropped"] == 3
    assert batch.stats["drop_reasons"] == {"zero reward variance": 2, "empty group": 1}
    assert {r.group_id for r in batch.rows} == {"good"}
    # Reward stats: every claimed trajectory vs the used ones.
    all_r = [1.0, 1.0 + 1e-9, 0.3, 1.0, 0.0]
    mean = sum(all_r) / 5
    assert batch.stats["reward_mean"] == pytest.approx(mean)
    assert batch.stats["reward_std"] == pytest.approx(math.sqrt(sum((r - mean) ** 2 for r in all_r) / 5))
    assert batch.stats["used_reward_mean"] == pytest.approx(0.5)
    assert batch.stats["used_reward_std"] == pytest.approx(0.5)
    assert batch.stats["trajectories"] == 5 and batch.stats["trajectories_used"] == 2


@pytest.mark.parametrize("kind", ["grpo", "cispo", "gspo"])
def test_kept_zero_variance_group_has_zero_advantage_and_zero_gradient(kind) -> None:
    same = group("same", traj("a", 1.0, call([1, 2], [3, 4], [-1.0, -2.0])), traj("b", 1.0, call([1], [5], [-0.5])))
    batch = build_samples([same], drop_zero_variance=False)
    assert [r.advantage for r in batch.rows] == [0.0, 0.0]
    t = collate(batch.rows)
    logprobs = (t["behaviour_logprobs"] + 0.3).requires_grad_(True)  # off-policy: clipping could act
    out = policy_loss(logprobs, t["behaviour_logprobs"], t["advantages"], t["loss_mask"], batch.trainable_tokens, LossConfig(kind=kind))
    out.loss.backward()
    assert torch.count_nonzero(logprobs.grad) == 0


def test_non_finite_rewards_and_stale_groups_are_dropped() -> None:
    nan = group("nan", traj("a", float("nan"), call([1], [2])), traj("b", 0.0, call([1], [3])))
    stale = group("stale", traj("c", 1.0, call([1], [2], version=2)), traj("d", 0.0, call([1], [3], version=5)))
    fresh = group("fresh", traj("e", 1.0, call([1], [2], version=3)), traj("f", 0.0, call([1], [3], version=5)))
    batch = build_samples([nan, stale, fresh], current_policy_version=6, max_staleness=3)
    assert batch.dropped_groups == [("nan", "non-finite reward"), ("stale", "stale policy")]
    assert batch.stats["policy_version_min"] == 3 and batch.stats["policy_version_max"] == 5
    # Without a current version staleness is not checked.
    assert build_samples([stale]).stats["groups_used"] == 1


# ------------------------------------------------------------------------------- batching


def _row(n: int, seq: int = 0) -> Row:
    return Row(list(range(1, n + 1)), [0] + [1] * (n - 1), [0.0] + [-0.5] * (n - 1), 0.5, "t", "g", (0,), seq)


def test_collate_shapes_padding_and_alignment() -> None:
    t = traj("t", 1.0, call([1, 2, 3], [4, 5], [-0.1, -0.2]), call([1, 2, 3, 4, 5, 6], [7], [-0.3], seq=1))
    batch = build_samples([group("g", t, traj("u", 0.0, call([8], [9], [-0.9])))])
    out = collate(batch.rows, pad_id=0)
    assert out["input_ids"].shape == (2, 7) and out["input_ids"].dtype == torch.long
    assert out["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7], [8, 9, 0, 0, 0, 0, 0]]
    assert out["attention_mask"].tolist() == [[1] * 7, [1, 1, 0, 0, 0, 0, 0]]
    assert out["loss_mask"].dtype == torch.float32
    # loss_mask[b, t] == 1 ⇔ input_ids[b, t] is a trained target (predicted from input_ids[b, :t]).
    assert out["loss_mask"].tolist() == [[0, 0, 0, 1, 1, 0, 1], [0, 1, 0, 0, 0, 0, 0]]
    torch.testing.assert_close(
        out["behaviour_logprobs"], torch.tensor([[0, 0, 0, -0.1, -0.2, 0, -0.3], [0, -0.9, 0, 0, 0, 0, 0]])
    )
    assert out["advantages"].shape == (2,)
    assert out["advantages"].tolist() == pytest.approx([1 / 1.000002, -1 / 1.000002], rel=1e-5)
    assert out["sequence_ids"].tolist() == [0, 1]
    assert out["lengths"].tolist() == [7, 2]
    assert collate(batch.rows, pad_to_multiple_of=8)["input_ids"].shape == (2, 8)


def test_micro_batches_respect_the_padded_token_budget() -> None:
    rows = [_row(n, i) for i, n in enumerate([5, 17, 3, 9, 9, 2, 12, 4, 30])]
    budget = 24
    batches = micro_batches(rows, budget)
    assert sorted(r.sequence_id for b in batches for r in b) == list(range(len(rows)))  # each row once
    for b in batches:
        padded = len(b) * max(len(r) for r in b)
        assert padded <= budget or len(b) == 1  # only a row over the budget on its own may exceed it
    assert [len(b[0]) for b in batches] == sorted((len(b[0]) for b in batches), reverse=True)  # longest first
    assert [[len(r) for r in b] for b in batches] == [[30], [17], [12, 9], [9, 5], [4, 3, 2]]
    with_multiple = micro_batches(rows, 24, pad_to_multiple_of=8)
    for b in with_multiple:
        assert len(b) * (-(-len(b[0]) // 8) * 8) <= 24 or len(b) == 1


def test_samples_to_micro_batched_loss_end_to_end_on_policy() -> None:
    """build → micro-batch → collate → loss with the global token count: on-policy the summed
    gradient is −A/N on every trained position, whatever the micro-batching."""
    g = group(
        "g",
        traj("a", 1.0, call([1, 2], [3, 4], [-0.3, -0.4]), call([1, 2, 3, 4, 5], [6], [-0.6], seq=1)),
        traj("b", 0.0, call([1, 2], [7, 8, 9], [-0.7, -0.8, -0.9])),
        traj("c", 0.5, call([1], [2], [-0.2])),
    )
    batch = build_samples([g])
    n = batch.trainable_tokens
    assert n == 7
    for kind in ("grpo", "cispo", "gspo"):
        for mb in micro_batches(batch.rows, 8):
            t = collate(mb)
            lp = t["behaviour_logprobs"].clone().requires_grad_(True)
            policy_loss(lp, t["behaviour_logprobs"], t["advantages"], t["loss_mask"], n, LossConfig(kind=kind), sequence_ids=t["sequence_ids"]).loss.backward()
            expected = -t["advantages"][:, None] * t["loss_mask"] / n
            torch.testing.assert_close(lp.grad, expected)


# ---------------------------------------------------------------------------------- call trees


def _trained_once(t: TrajectoryData, rows: list[Row]) -> None:
    """Every trainable completion token of the trajectory carries loss in exactly one row."""
    assert sum(r.trainable_tokens for r in rows) == sum(len(c.completion_token_ids or []) for c in t.calls)


def test_a_supervisor_resumes_its_own_row_after_a_sub_agent() -> None:
    t = traj(
        "t",
        1.0,
        call([1, 2], [3], seq=0),  # supervisor
        call([7, 8], [9], seq=1),  # sub-agent: another system prompt, a root
        call([7, 8, 9, 10], [11], seq=2),  # sub-agent's second turn
        call([1, 2, 3, 11, 12], [13], seq=3),  # supervisor resumes with the result
    )
    batch = build_samples([with_partner(t)])
    rows = rows_of(batch, "t")
    assert [r.input_ids for r in rows] == [[1, 2, 3, 11, 12, 13], [7, 8, 9, 10, 11]]
    _trained_once(t, rows)
    s = batch.stats
    assert (s["roots"], s["forks"], s["tokens_trained_twice"]) == (2 + 1, 0, 0)
    assert s["merge_breaks"] == {"unknown": 1} and s["merged_calls"] == 2


def test_parallel_branches_become_one_row_per_path_with_the_shared_prefix_trained_once() -> None:
    t = traj(
        "t",
        1.0,
        call([1, 2], [3, 4], seq=0),  # plan
        call([1, 2, 3, 4, 5], [6], seq=1),  # branch a
        call([1, 2, 3, 4, 7], [8], seq=2),  # branch b, at the same time
        call([1, 2, 3, 4, 5, 6, 9], [10], seq=3),  # a goes on
    )
    batch = build_samples([with_partner(t)])
    rows = rows_of(batch, "t")
    assert [r.input_ids for r in rows] == [[1, 2, 3, 4, 5, 6, 9, 10], [1, 2, 3, 4, 7, 8]]
    assert rows[0].loss_mask == [0, 0, 1, 1, 0, 1, 0, 1]
    assert rows[1].loss_mask == [0, 0, 0, 0, 0, 1]  # the plan's answer is context here
    _trained_once(t, rows)
    s = batch.stats
    assert (s["forks"], s["shared_prefix_tokens"], s["tokens_trained_twice"]) == (1, 4, 0)
    assert s["rows_per_trajectory"] == pytest.approx(3 / 2)  # t's two rows, the partner's one


def test_a_call_extends_the_longest_recorded_call_and_the_lowest_seq_on_a_tie() -> None:
    t = traj(
        "t",
        1.0,
        call([1], [2], seq=0),
        call([1], [2], seq=1),  # the same ids again: a second sample, a row of its own
        call([1, 2, 5], [6], seq=2),  # extends both: goes on from seq 0's row
    )
    rows = rows_of(build_samples([with_partner(t)]), "t")
    assert [r.input_ids for r in rows] == [[1, 2, 5, 6], [1, 2]]


def test_tokens_trained_twice_counts_a_shared_prefix_trained_in_every_path() -> None:
    def row(ids: list[int], mask: list[int], tid: str = "t") -> Row:
        return Row(ids, mask, [0.0] * len(ids), 1.0, tid, "g")

    naive = [row([1, 2, 3, 4, 5], [0, 0, 1, 1, 1]), row([1, 2, 3, 4, 7], [0, 0, 1, 1, 1])]
    assert tokens_trained_twice(naive) == 2
    masked = [naive[0], row([1, 2, 3, 4, 7], [0, 0, 0, 0, 1])]
    assert tokens_trained_twice(masked) == 0
    other_trajectory = [naive[0], row([1, 2, 3, 4, 7], [0, 0, 1, 1, 1], tid="u")]
    assert tokens_trained_twice(other_trajectory) == 0
