"""Loss "sft": the cross-entropy and its token accuracy, the selection of trajectories (threshold, best k, ties), the
run config's rules, and a trainer step and the worker loop that lower the cross-entropy of the selected rows."""

from __future__ import annotations

import math
import random
from pathlib import Path

import httpx
import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from gateway.runs.config import RunConfig
from gateway.store import db
from gateway.store.runs import record_train_step, steps_after, upsert_run
from gateway.store.training import group_states
from tests.support.gateway_harness import RunningGateway
from tests.support.openai_calls import assert_openai_error
from tests.support.tiny_models import PATTERN, VOCAB, build_tiny_llama, make, row
from tests.support.trainer_runs import made, make_trainer, seed_groups
from tests.support.training_data import call, group, traj
from trainer.loss import LossConfig, StepTotals, chunked_token_logprobs, chunked_token_scores, policy_loss, sft_loss
from trainer.samples import Row, SftSelection, build_samples, select_trajectories
from trainer.step import train_step
from trainer.worker.loop import format_step

SFT = LossConfig(kind="sft")

# ------------------------------------------------------------------------------------ the loss


def scored(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float64 logits [2, 4, 5] (a leaf), their target-aligned logprobs, the argmax hits, and a mask of 5 tokens."""
    torch.manual_seed(seed)
    logits = torch.randn(2, 4, 5, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([[3, 1, 4, 4], [0, 2, 2, 1]])
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    hits = logits.detach().argmax(-1) == targets
    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.float64)
    return logits, targets, logprobs, hits, mask


def by_hand(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    """−log softmax(logits)[target] of every masked position, row by row, in plain Python floats."""
    out = []
    for b in range(logits.shape[0]):
        ces = []
        for t in range(logits.shape[1]):
            if mask[b, t]:
                z = [float(v) for v in logits[b, t].detach()]
                ces.append(math.log(sum(math.exp(v) for v in z)) - z[int(targets[b, t])])
        out.append(ces)
    return out


def test_sft_loss_is_the_mean_cross_entropy_of_the_trained_tokens() -> None:
    logits, targets, logprobs, hits, mask = scored()
    out = sft_loss(logprobs, hits, mask, StepTotals(tokens=5, sequences=2), SFT)
    per_row = by_hand(logits, targets, mask)
    every = [ce for ces in per_row for ce in ces]
    assert out.loss.item() == pytest.approx(sum(every) / 5, rel=1e-12)
    assert out.metrics["sft_loss"].item() == pytest.approx(sum(every) / 5, rel=1e-6)
    assert out.metrics["tokens"].item() == 5
    on = mask > 0
    assert out.metrics["token_accuracy"].item() == pytest.approx(float(hits[on].sum()) / 5)

    # Its gradient is torch's cross-entropy's on the same tokens.
    (grad,) = torch.autograd.grad(out.loss, logits)
    reference = logits.detach().clone().requires_grad_(True)
    F.cross_entropy(reference[on], targets[on]).backward()
    torch.testing.assert_close(grad, reference.grad, rtol=1e-12, atol=1e-15)


def test_sft_loss_aggregations_and_micro_batches() -> None:
    logits, targets, logprobs, hits, mask = scored(1)
    per_row = by_hand(logits, targets, mask)
    totals = StepTotals(tokens=5, sequences=2)
    sequence = sft_loss(logprobs, hits, mask, totals, LossConfig(kind="sft", aggregation="sequence"))
    assert sequence.loss.item() == pytest.approx(sum(sum(c) / len(c) for c in per_row) / 2, rel=1e-12)
    constant = sft_loss(logprobs, hits, mask, totals, LossConfig(kind="sft", aggregation="constant", norm_tokens=8))
    assert constant.loss.item() == pytest.approx(sum(sum(c) for c in per_row) / (2 * 8), rel=1e-12)
    # One row per micro-batch, the step's totals: the shares add up to the whole batch's loss.
    whole = sft_loss(logprobs, hits, mask, totals, SFT).loss
    parts = sum(sft_loss(logprobs[b : b + 1], hits[b : b + 1], mask[b : b + 1], totals, SFT).loss for b in range(2))
    assert float(parts) == pytest.approx(float(whole), rel=1e-12)


def test_sft_is_its_own_loss_and_no_policy_objective() -> None:
    _, _, logprobs, hits, mask = scored()
    with pytest.raises(ValueError, match="sft_loss"):
        policy_loss(logprobs, torch.zeros_like(logprobs), torch.zeros(2), mask, 5.0, SFT)
    with pytest.raises(ValueError, match="kind 'sft'"):
        sft_loss(logprobs, hits, mask, StepTotals(tokens=5, sequences=2), LossConfig(kind="cispo"))


def test_chunked_scores_are_the_full_logits_logprobs_and_argmax() -> None:
    torch.manual_seed(2)
    hidden = torch.randn(2, 7, 8, requires_grad=True)
    weight = torch.randn(11, 8)
    targets = torch.randint(0, 11, (2, 7))
    targets[0, :3] = (hidden.detach() @ weight.T).argmax(-1)[0, :3]  # some hits for certain
    logprobs, hits = chunked_token_scores(hidden, weight, targets, chunk=3)
    full = torch.log_softmax(hidden @ weight.T, dim=-1)
    torch.testing.assert_close(logprobs, full.gather(-1, targets[..., None]).squeeze(-1))
    assert torch.equal(hits, full.argmax(-1) == targets) and hits[0, :3].all()
    torch.testing.assert_close(logprobs, chunked_token_logprobs(hidden, weight, targets, chunk=3))
    logprobs.sum().backward()  # differentiable through the checkpointed chunks
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------ selection


def test_threshold_selects_every_trajectory_at_or_above_it() -> None:
    assert select_trajectories([0.0, 0.5, 1.0, 0.49], SftSelection(min_reward=0.5)) == [False, True, True, False]


def test_best_k_ties_go_to_the_earlier_trajectory_and_k_is_exact() -> None:
    rewards = [0.2, 1.0, 0.5, 1.0, 0.5]
    assert select_trajectories(rewards, SftSelection(best_k=1)) == [False, True, False, False, False]
    assert select_trajectories(rewards, SftSelection(best_k=3)) == [False, True, True, True, False]
    assert select_trajectories([0.0, 0.0], SftSelection(best_k=5)) == [True, True]  # a small group: all of it


@pytest.mark.parametrize("rule", [{}, {"min_reward": 1.0, "best_k": 2}, {"best_k": 0}])
def test_a_selection_is_exactly_one_valid_rule(rule: dict) -> None:
    with pytest.raises(ValueError):
        SftSelection(**rule)


def two_turns(tid: str, reward: float) -> object:
    """A multi-turn trajectory: the second call's prompt extends the first call's prompt and completion."""
    first = call([1, 2, 3], [4, 5], seq=1)
    second = call([1, 2, 3, 4, 5, 9, 9], [6, 7, 8], seq=2)
    return traj(tid, reward, first, second)


def test_sft_trains_the_selected_trajectories_rows_as_the_grpo_path_builds_them() -> None:
    groups = [
        group("g0", two_turns("a", 1.0), two_turns("b", 0.0), two_turns("c", 1.0)),
        group("g1", two_turns("d", 1.0), two_turns("e", 1.0)),  # all right: no variance, still trained by SFT
        group("g2", two_turns("f", 0.0), two_turns("g", 0.0)),  # nothing selected: consumed, and said so
    ]
    sft = build_samples(groups, sft=SftSelection(min_reward=1.0))
    assert sorted(r.trajectory_id for r in sft.rows) == ["a", "c", "d", "e"]
    assert sft.dropped_groups == [("g2", "no trajectory selected")]
    assert sft.stats["drop_reasons"] == {"no trajectory selected": 1}
    assert sft.stats["trajectories_selected"] == 4 and sft.stats["used_reward_mean"] == 1.0
    assert sft.stats["groups_used"] == 2 and sft.stats["trajectories_used"] == 5
    assert all(r.advantage == 0.0 for r in sft.rows)

    grpo = build_samples(groups)  # the same rows, masks and tokens as the policy objectives train
    (a_rl,) = [r for r in grpo.rows if r.trajectory_id == "a"]
    (a_sft,) = [r for r in sft.rows if r.trajectory_id == "a"]
    assert (a_sft.input_ids, a_sft.loss_mask) == (a_rl.input_ids, a_rl.loss_mask)
    assert a_sft.input_ids == [1, 2, 3, 4, 5, 9, 9, 6, 7, 8] and a_sft.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]

    best = build_samples(groups, sft=SftSelection(best_k=1))
    assert sorted(r.trajectory_id for r in best.rows) == ["a", "d", "f"]  # ties: the earlier one
    assert best.dropped_groups == []


# ------------------------------------------------------------------------------------ run config


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"loss": "sft"}, "exactly one of sft_min_reward or sft_best_k"),
        ({"loss": "sft", "sft_min_reward": 1.0, "sft_best_k": 2}, "exactly one of"),
        ({"loss": "cispo", "sft_best_k": 2}, "sft_best_k applies to loss 'sft' only"),
        ({"loss": "grpo", "sft_min_reward": 0.5}, "sft_min_reward applies to loss 'sft' only"),
        ({"loss": "sft", "sft_best_k": 0}, "greater than or equal to 1"),
        ({"loss": "sft", "sft_min_reward": float("nan")}, "finite"),
    ],
)
def test_run_config_refuses_sft_without_exactly_one_selection(config: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        RunConfig.model_validate(config)


def test_run_config_keeps_an_sft_selection() -> None:
    stored = RunConfig.model_validate({"loss": "sft", "sft_best_k": 2}).stored()
    assert (stored["loss"], stored["sft_best_k"], "sft_min_reward" in stored) == ("sft", 2, False)


def post_run(gw: RunningGateway, body: dict) -> httpx.Response:
    return httpx.post(gw.base_url + "/runs", json=body, timeout=30)


def test_post_runs_answers_422_for_a_bad_sft_config_and_the_run_page_charts_sft(
    gateway: RunningGateway, db_url: str
) -> None:
    for config in ({"loss": "sft"}, {"loss": "sft", "sft_min_reward": 1, "sft_best_k": 1}, {"sft_best_k": 1}):
        error = assert_openai_error(post_run(gateway, {"name": "sft", "config": config}), 422)
        assert "sft" in error["message"], error
    created = post_run(gateway, {"name": "sft", "config": {"loss": "sft", "sft_min_reward": 1}})
    assert created.status_code == 201, created.text
    assert created.json()["config"]["sft_min_reward"] == 1

    engine = db.make_engine(db_url)
    try:
        record_train_step(engine, "sft", 1, {"loss": 1.5, "sft_loss": 1.5, "token_accuracy": 0.25, "grad_norm": 0.5})
    finally:
        engine.dispose()
    steps = httpx.get(gateway.base_url + "/runs/sft/steps", timeout=30).json()["data"]
    assert steps[0]["metrics"]["token_accuracy"] == 0.25  # the read API serves the step's metrics as recorded
    page = httpx.get(gateway.url + "/ui/run", params={"name": "sft"}, timeout=30).text
    assert 'data-metric="token_accuracy"' in page and 'data-metric="loss"' in page
    assert 'data-metric="ratio_mean"' not in page  # an SFT step has no ratio to chart


# ------------------------------------------------------------------------------------ training


def mean_ce(policy: object, rows: list[Row]) -> float:
    """The mean cross-entropy of the rows' trained tokens under the policy's current weights."""
    logprobs = policy.token_logprobs(rows)  # type: ignore[attr-defined]
    values = [-lp for r, lps in zip(rows, logprobs, strict=True) for lp, m in zip(lps, r.loss_mask, strict=True) if m]
    return sum(values) / len(values)


def test_sft_steps_lower_the_cross_entropy_and_report_it(tiny_model: str) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(5)] for _ in range(4)]
    rows = [row(prompt, [PATTERN] * 4, advantage=0.0, sequence_id=i) for i, prompt in enumerate(prompts)]
    policy = make(tiny_model, lr=1e-2)
    before = mean_ce(policy, rows)
    seen = [before]
    for step in range(3):
        metrics = train_step(policy, rows, SFT, micro_batch_tokens=20)
        assert metrics["sft_loss"] == pytest.approx(seen[-1], rel=1e-4)  # the CE before this step's update
        assert metrics["loss"] == pytest.approx(metrics["sft_loss"], rel=1e-5)  # token aggregation: the mean CE
        assert 0 <= metrics["token_accuracy"] <= 1 and "ratio_mean" not in metrics
        seen.append(mean_ce(policy, rows))
        assert seen[-1] < seen[-2], (step, seen)
    assert metrics["token_accuracy"] > 0  # the repeated token has become the argmax somewhere


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-sft")))


def test_the_worker_trains_sft_on_the_selected_trajectories(db_url: str, tmp_path: Path, tiny_model: str) -> None:
    db.upgrade(db_url)
    seed_groups(db_url, tiny_model, groups=4)  # per group: two right (PATTERN repeated, reward 1), two wrong
    engine = db.make_engine(db_url)
    try:
        upsert_run(engine, "loop", {"groups_per_step": 2, "learning_rate": 1e-2, "loss": "sft", "sft_min_reward": 1.0})
        lines: list[str] = []
        trainer = make_trainer(db_url, tmp_path, tiny_model, echo=lines.append, max_steps=1)
        good = [
            row([1, 2, 3, 4, 5, 6], [PATTERN] * 5, advantage=0.0, sequence_id=i) for i in range(2)
        ]  # the selected completions, after an unseen prompt
        ces = [mean_ce(trainer.backend, good)]
        for _ in range(2):
            assert trainer.run() == 1
            ces.append(mean_ce(trainer.backend, good))
        assert ces[2] < ces[1] < ces[0], ces
        steps = steps_after(engine, "loop")
        states = group_states(engine, "loop")
    finally:
        engine.dispose()
        while made:
            made.pop().close()
    assert [s["step"] for s in steps] == [1, 2]
    for step in steps:
        m = step["metrics"]
        assert m["trajectories_selected"] == 4 and m["trajectories_used"] == 8  # 2 of 4 in each of 2 groups
        assert m["trainable_tokens"] == 4 * 5 and m["used_reward_mean"] == 1.0
        assert m["sft_loss"] > 0 and 0 <= m["token_accuracy"] <= 1 and "ratio_mean" not in m
    assert steps[1]["metrics"]["sft_loss"] < steps[0]["metrics"]["sft_loss"]
    assert sorted(states.values()) == ["trained"] * 4  # the unselected trajectories are consumed with their group
    assert "token accuracy" in lines[-1]


def test_the_step_line_of_an_sft_run() -> None:
    metrics = {
        "reward_mean": 0.5, "reward_std": 0.5, "groups_used": 2, "groups_dropped": 1, "tokens": 40,
        "trainable_tokens": 20, "loss": 1.25, "token_accuracy": 0.35, "grad_norm": 0.5, "step_seconds": 1.0,
        "tokens_per_s": 40.0,
    }
    line = format_step(3, metrics)
    assert "loss +1.2500 | token accuracy 0.350 | grad 0.500" in line and "ratio" not in line
