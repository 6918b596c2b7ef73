"""The UI for runs that are not GRPO-family: an SFT run's and a distillation run's pages chart and tabulate their own
metrics (token accuracy; reverse KL, teacher agreement), a run warm-started by `--sft-data` says so, and the group
page says what the objective trained instead of presenting GRPO advantages; on Postgres and SQLite."""

from __future__ import annotations

import html
import json
import re

import httpx
import pytest

from gateway.store import db
from gateway.store.records import write_calls
from gateway.store.rewards import RewardItem, store_rewards
from gateway.store.runs import record_train_step, upsert_run
from gateway.store.ui_reads import sft_selected
from gateway.ui.pages import step_columns
from tests.support.factories import make_record
from tests.support.gateway_harness import RunningGateway
from trainer.samples import SftSelection, select_trajectories


def text_of(page: str) -> str:
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page)))


def seed_group(db_url: str, run: str, config: dict, rewards: list[float]) -> None:
    engine = db.make_engine(db_url)
    try:
        upsert_run(engine, run, config, base_model="smollm2")
        group = f"{run}-g"
        write_calls(engine, [make_record(f"{group}-t{i}", seq=1, run=run, group_id=group, group_size=len(rewards))
                             for i in range(len(rewards))])  # fmt: skip
        store_rewards(engine, [RewardItem(f"{group}-t{i}", r) for i, r in enumerate(rewards)])
    finally:
        engine.dispose()


def step(db_url: str, run: str, number: int, metrics: dict) -> None:
    engine = db.make_engine(db_url)
    try:
        record_train_step(engine, run, number, metrics)
    finally:
        engine.dispose()


def chart_data(raw: str) -> dict:
    found = re.search(r'<script type="application/json" id="run-data">(.*?)</script>', raw, re.S)
    assert found is not None
    return json.loads(found.group(1))


def test_an_sft_run_shows_its_metrics_and_its_selection(gateway: RunningGateway, db_url: str) -> None:
    seed_group(db_url, "rft", {"loss": "sft", "sft_best_k": 2}, [0.2, 0.9, 0.9, 0.1])
    step(db_url, "rft", 1, {"reward_mean": 0.5, "loss": 1.25, "sft_loss": 1.25, "token_accuracy": 0.375,
                            "grad_norm": 0.5, "groups_used": 1, "groups_dropped": 0})  # fmt: skip
    raw = httpx.get(gateway.url + "/ui/run", params={"name": "rft"}, timeout=30).text
    page = text_of(raw)
    assert "loss sft: cross-entropy on the best 2 trajectories of each group (no advantage)" in page
    assert "ratio mean" not in page and "token accuracy" in page
    assert "1 0.500 1.2500 0.375 0.500 1 0" in page  # step, reward, loss, token accuracy, grad norm, groups
    assert chart_data(raw)["columns"] == [["token_accuracy", 3]]
    assert 'data-metric="token_accuracy"' in raw and 'data-metric="reverse_kl"' not in raw

    group = text_of(httpx.get(gateway.url + "/ui/group", params={"id": "rft-g"}, timeout=30).text)
    assert "trained by SFT (loss sft)" in group and "the best 2 of the group; no advantage" in group
    assert "advantage" not in group.replace("no advantage", "")  # no GRPO advantage presented
    for i, (reward, chosen) in enumerate([(0.2, False), (0.9, True), (0.9, True), (0.1, False)]):
        assert f"rft-g-t{i} reward {reward:.3f} · {'selected for SFT' if chosen else 'not selected'}" in group


def test_a_distill_run_shows_reverse_kl_and_teacher_agreement(gateway: RunningGateway, db_url: str) -> None:
    seed_group(db_url, "student", {"loss": "distill", "teacher": "demo@10"}, [1.0, 0.0])
    step(db_url, "student", 1, {"reward_mean": 0.5, "reward_std": 0.5, "loss": 0.0123, "ratio_mean": 1.001,
                                "ratio_max": 1.2, "clip_frac": 0.0, "reverse_kl": 0.4567, "teacher_agreement": 0.625,
                                "grad_norm": 0.25})  # fmt: skip
    raw = httpx.get(gateway.url + "/ui/run", params={"name": "student"}, timeout=30).text
    page = text_of(raw)
    assert "loss distill: per-token reverse KL to teacher demo@10" in page
    assert "reverse KL teacher agrees grad norm" in page  # the table's headers
    assert "1 0.500 0.500 0.0123 1.001 1.200 0.000 0.4567 0.625 0.250" in page
    assert 'data-metric="reverse_kl"' in raw and 'data-metric="teacher_agreement"' in raw
    assert 'data-metric="token_accuracy"' not in raw

    group = text_of(httpx.get(gateway.url + "/ui/group", params={"id": "student-g"}, timeout=30).text)
    assert "trained by distillation (loss distill) from teacher demo@10" in group
    assert "log π_teacher − log π_student" in group and "advantage per token, from the teacher" in group
    assert "advantage 1.000" not in group  # the group advantage plays no part at distill_reward_weight 0

    seed_group(db_url, "mixed", {"loss": "distill", "teacher": "t", "distill_reward_weight": 0.5}, [1.0, 0.0])
    mixed = text_of(httpx.get(gateway.url + "/ui/group", params={"id": "mixed-g"}, timeout=30).text)
    assert "+ 0.5 × the reward advantage below (group)" in mixed and "reward advantage 1.000" in mixed


def test_a_warm_started_run_says_which_steps_the_file_trained(gateway: RunningGateway, db_url: str) -> None:
    seed_group(db_url, "warm", {}, [1.0, 0.0])
    for n in (1, 2):
        step(db_url, "warm", n, {"objective": "sft_data", "sft_data": "good.jsonl", "epoch": n, "loss": 1.5 - n / 4,
                                 "sft_loss": 1.5 - n / 4, "token_accuracy": 0.25 * n, "grad_norm": 0.5})  # fmt: skip
    step(db_url, "warm", 3, {"reward_mean": 0.5, "loss": -0.01, "ratio_mean": 1.0, "ratio_max": 1.1, "clip_frac": 0.0,
                             "grad_norm": 0.3, "groups_used": 1, "groups_dropped": 0})  # fmt: skip
    raw = httpx.get(gateway.url + "/ui/run", params={"name": "warm"}, timeout=30).text
    page = text_of(raw)
    assert "loss cispo, advantage group" in page
    assert "warm start: steps 1–2 trained on good.jsonl (--sft-data)" in page
    assert "2 1.0000 0.500 0.500 sft data good.jsonl, epoch 2" in page  # loss, token accuracy, grad norm
    assert "3 0.500 -0.0100 1.000 1.100 0.000 0.300 1 0" in page
    assert [c[0] for c in chart_data(raw)["columns"]] == ["ratio_mean", "ratio_max", "clip_frac", "token_accuracy"]


@pytest.mark.parametrize(
    ("loss", "steps", "expected"),
    [
        ("cispo", [], ["ratio_mean", "ratio_max", "clip_frac"]),
        ("sft", [], ["token_accuracy"]),
        ("distill", [], ["ratio_mean", "ratio_max", "clip_frac", "reverse_kl", "teacher_agreement"]),
        ("cispo", [{"metrics": {"token_accuracy": 0.5}}], ["token_accuracy"]),
    ],
)
def test_the_columns_before_and_after_the_first_step(loss: str, steps: list, expected: list[str]) -> None:
    assert [key for key, _, _ in step_columns(loss, steps)] == expected


def test_the_selection_shown_is_the_trainers() -> None:
    for rewards in ([0.2, 0.9, 0.9, 0.1], [1.0, 1.0, 1.0], [0.5], [0.3, 0.1, 0.3, 0.3]):
        for k in (1, 2, 5):
            assert sft_selected(rewards, None, k) == select_trajectories(rewards, SftSelection(best_k=k))
        for tau in (0.3, 1.0):
            assert sft_selected(rewards, tau, None) == select_trajectories(rewards, SftSelection(min_reward=tau))
