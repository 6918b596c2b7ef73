"""Loss "distill": the per-token advantage and gradient against a hand-computed reverse-KL policy gradient, its metrics,
the run config's rules, a trainer step that moves the student towards the teacher, and the worker loop with a fake
teacher that answers in recorded vLLM's shape (and is unreachable at first)."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import torch
from pydantic import ValidationError

from gateway.runs.config import RunConfig
from gateway.store import db
from gateway.store.rewards import RewardItem, store_rewards
from gateway.store.runs import steps_after, upsert_run
from tests.support.gateway_harness import RunningGateway
from tests.support.openai_calls import assert_openai_error
from tests.support.tiny_models import PATTERN, make, row
from tests.support.trainer_runs import made, make_trainer, seed_groups
from trainer.loss import LossConfig, StepTotals, distill_advantages, distill_loss, policy_loss
from trainer.samples import Row
from trainer.step import train_step
from trainer.worker.loop import format_step

DISTILL = LossConfig(kind="distill")

# ------------------------------------------------------------------------------------ the loss


def example(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float64 student logits [2, 4, 5] (a leaf), targets, the student's target logprobs, the teacher's, and a mask of
    5 tokens."""
    torch.manual_seed(seed)
    logits = torch.randn(2, 4, 5, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([[3, 1, 4, 4], [0, 2, 2, 1]])
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    teacher = torch.log_softmax(3 * torch.randn(2, 4, 5, dtype=torch.float64), -1).gather(-1, targets[..., None])
    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.float64)
    return logits, targets, logprobs, teacher.squeeze(-1), mask


def reverse_kl_gradient(
    logits: torch.Tensor, targets: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, extra: list[float]
) -> list[list[list[float]]]:
    """The gradient of the per-token reverse KL, (1/N) Σ_t m_t KL-estimate_t, by the score function, with the reward
    term extra_b added to the advantage, in plain floats: at each trained position
    −(1/N)·(log q_t − log p_t + extra_b)·(onehot(target) − softmax(logits)), 0 elsewhere."""
    n = float(mask.sum())
    out = []
    for b in range(logits.shape[0]):
        rows = []
        for t in range(logits.shape[1]):
            z = [float(v) for v in logits[b, t].detach()]
            total = sum(math.exp(v) for v in z)
            p = [math.exp(v) / total for v in z]
            if not mask[b, t]:
                rows.append([0.0] * len(z))
                continue
            log_p = math.log(p[int(targets[b, t])])
            advantage = float(teacher[b, t]) - log_p + extra[b]
            rows.append([-(advantage / n) * ((1.0 if v == int(targets[b, t]) else 0.0) - p[v]) for v in range(len(z))])
        out.append(rows)
    return out


def test_distill_gradient_is_the_reverse_kl_policy_gradient() -> None:
    logits, targets, logprobs, teacher, mask = example()
    behaviour = logprobs.detach()  # fresh data: vLLM's recorded logprobs are the student's
    out = distill_loss(logprobs, behaviour, teacher, torch.zeros(2), mask, StepTotals(5, 2), DISTILL)
    out.loss.backward()
    assert logits.grad is not None
    expected = torch.tensor(reverse_kl_gradient(logits, targets, teacher, mask, [0.0, 0.0]), dtype=torch.float64)
    torch.testing.assert_close(logits.grad, expected, rtol=0, atol=1e-12)
    on = mask > 0
    expected_kl = float((behaviour - teacher)[on].mean())
    assert float(out.metrics["reverse_kl"]) == pytest.approx(expected_kl, rel=1e-12)
    assert expected_kl > 0  # random teacher vs random student: a KL estimate, not zero
    agree = float((teacher[on] >= math.log(0.5)).double().mean())
    assert float(out.metrics["teacher_agreement"]) == pytest.approx(agree)
    assert float(out.metrics["clip_frac"]) == 0 and float(out.metrics["ratio_mean"]) == pytest.approx(1.0)


def test_distill_mixes_in_the_task_reward_by_its_weight() -> None:
    logits, targets, logprobs, teacher, mask = example(1)
    rewards = torch.tensor([1.5, -0.5], dtype=torch.float64)
    config = LossConfig(kind="distill", distill_reward_weight=0.4)
    distill_loss(logprobs, logprobs.detach(), teacher, rewards, mask, StepTotals(5, 2), config).loss.backward()
    assert logits.grad is not None
    expected = reverse_kl_gradient(logits, targets, teacher, mask, [0.4 * 1.5, 0.4 * -0.5])
    torch.testing.assert_close(logits.grad, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)


def test_the_advantage_uses_the_recorded_behaviour_logprobs_and_is_zero_off_the_mask() -> None:
    _, _, logprobs, teacher, mask = example(2)
    behaviour = logprobs.detach() - 0.05  # what vLLM recorded, a little off the trainer's current logprobs
    advantages = distill_advantages(teacher, behaviour, torch.zeros(2, dtype=torch.float64), mask, 0.0)
    assert not advantages.requires_grad
    assert advantages[mask > 0].tolist() == pytest.approx((teacher - behaviour)[mask > 0].tolist())
    assert advantages[mask == 0].abs().max() == 0
    # ... and the surrogate is grpo's PPO-clip with that advantage (the ratio against vLLM applies)
    out = distill_loss(logprobs, behaviour, teacher, torch.zeros(2), mask, StepTotals(5, 2), DISTILL)
    same = policy_loss(logprobs, behaviour, advantages, mask, StepTotals(5, 2), LossConfig(kind="grpo"))
    assert float(out.loss.detach()) == pytest.approx(float(same.loss.detach()), rel=1e-12)
    assert float(out.metrics["ratio_mean"]) == pytest.approx(math.exp(0.05), rel=1e-9)


def test_distill_is_not_a_bare_policy_objective() -> None:
    _, _, logprobs, teacher, mask = example()
    with pytest.raises(ValueError, match="distill_loss"):
        policy_loss(logprobs, logprobs.detach(), teacher, mask, StepTotals(5, 2), DISTILL)
    with pytest.raises(ValueError, match="kind 'distill' only"):
        LossConfig(kind="grpo", distill_reward_weight=0.5)


# ------------------------------------------------------------------------------------ run config


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"loss": "distill"}, "needs teacher"),
        ({"loss": "cispo", "teacher": "big"}, "teacher applies to loss 'distill' only"),
        ({"loss": "grpo", "distill_reward_weight": 0.5}, "distill_reward_weight applies to loss 'distill' only"),
        ({"loss": "sft", "sft_best_k": 1, "teacher_base_url": "http://t:8000/v1"}, "teacher_base_url applies"),
        ({"loss": "distill", "teacher": "big", "distill_reward_weight": -1}, "greater than or equal to 0"),
        ({"loss": "distill", "teacher": "big", "teacher_base_url": "ftp://x"}, "should match pattern"),
        ({"loss": "distill", "teacher": "has space"}, "should match pattern"),
        ({"loss": "distill", "teacher": "big", "truncated_is_cap": 2.0}, "truncated_is_cap applies to loss 'grpo'"),
    ],
)
def test_run_config_refuses_bad_distill_combinations(config: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        RunConfig.model_validate(config)


def test_post_runs_answers_422_for_a_bad_distill_config(gateway: RunningGateway) -> None:
    for config in ({"loss": "distill"}, {"teacher": "big"}):
        response = httpx.post(gateway.base_url + "/runs", json={"name": "kd", "config": config}, timeout=30)
        assert "teacher" in assert_openai_error(response, 422)["message"]
    body = {"name": "kd", "config": {"loss": "distill", "teacher": "demo@10", "distill_reward_weight": 0.5}}
    created = httpx.post(gateway.base_url + "/runs", json=body, timeout=30)
    assert created.status_code == 201, created.text
    assert created.json()["config"]["teacher"] == "demo@10"


# ------------------------------------------------------------------------------------ training


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.support.tiny_models import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-distill")))


def with_teacher(rows: list[Row], policy: object, sure: int) -> list[Row]:
    """The rows with the student's own logprobs as behaviour and a teacher sure (logprob −0.01) of token `sure`
    wherever it was sampled, and doubtful (−6) of everything else."""
    own = policy.token_logprobs(rows)  # type: ignore[attr-defined]
    for r, lps in zip(rows, own, strict=True):
        r.behaviour_logprobs = [lp if m else 0.0 for lp, m in zip(lps, r.loss_mask, strict=True)]
        r.teacher_logprobs = [0.0] + [-0.01 if i == sure else -6.0 for i in r.input_ids[1:]]
    return rows


def test_distill_steps_move_the_student_towards_the_teacher(tiny_model: str) -> None:
    policy = make(tiny_model, lr=1e-2)
    seen = []
    for _ in range(3):
        rows = [row([1, 2, 3, 4], [PATTERN] * 4, advantage=0.0, sequence_id=i) for i in range(3)]
        rows = with_teacher(rows, policy, PATTERN)
        student = sum(sum(r.behaviour_logprobs) for r in rows) / 12  # its mean logprob of the 12 sampled tokens
        metrics = train_step(policy, rows, DISTILL, micro_batch_tokens=16)
        # the per-token estimate of KL(student ‖ teacher) on these samples: log p − log q
        assert metrics["reverse_kl"] == pytest.approx(student + 0.01, rel=1e-5)
        assert metrics["teacher_agreement"] == 1.0 and metrics["ratio_mean"] == pytest.approx(1, abs=1e-3)
        seen.append(student)
    assert seen[0] < seen[1] < seen[2], seen  # the student raises the logprob of what the teacher is sure of
    missing = [row([1, 2], [PATTERN], advantage=0.0, sequence_id=0)]
    with pytest.raises(ValueError, match="never trains without them"):
        train_step(policy, missing, DISTILL, micro_batch_tokens=16)


# ------------------------------------------------------------------------------------ the worker, with a fake teacher


class FakeTeacher:
    """A stdlib HTTP server answering /v1/completions like vLLM's prompt_logprobs (the recorded fixture's shape): sure
    of PATTERN (−0.01), doubtful of the rest (−6); the first `outages` requests answer 503."""

    def __init__(self, outages: int) -> None:
        self.outages, self.requests = outages, []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append(body)
                if len(fake.requests) <= fake.outages:
                    self.send_response(503)
                    self.end_headers()
                    return
                choices = [
                    {
                        "index": i,
                        "prompt_token_ids": ids,
                        "prompt_logprobs": [None]
                        + [{str(t): {"logprob": -0.01 if t == PATTERN else -6.0, "rank": 1}} for t in ids[1:]],
                    }
                    for i, ids in enumerate(body["prompt"])
                ]
                data = json.dumps({"object": "text_completion", "model": body["model"], "choices": choices}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"


@pytest.fixture
def fake_teacher() -> Iterator[FakeTeacher]:
    teacher = FakeTeacher(outages=2)
    yield teacher
    teacher.server.shutdown()
    teacher.server.server_close()


def test_the_worker_distills_after_waiting_for_the_teacher(
    db_url: str, tmp_path: Path, tiny_model: str, fake_teacher: FakeTeacher, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("trainer.teacher.Teacher.backoff_s", 0.01)
    db.upgrade(db_url)
    seed_groups(db_url, tiny_model, groups=2)
    engine = db.make_engine(db_url)
    try:
        store_rewards(engine, [RewardItem(f"g0-t{t}", 1.0) for t in range(4)])  # g0: all equal, no reward signal
        config = {"groups_per_step": 2, "learning_rate": 1e-2, "loss": "distill", "teacher": "big@3",
                  "teacher_base_url": fake_teacher.base_url}  # fmt: skip
        upsert_run(engine, "loop", config)
        lines: list[str] = []
        trainer = make_trainer(db_url, tmp_path, tiny_model, echo=lines.append, max_steps=1)
        assert trainer.run() == 1
        (step,) = steps_after(engine, "loop")
    finally:
        engine.dispose()
        while made:
            made.pop().close()
    m = step["metrics"]
    # g0's equal rewards drop nothing: its tokens still carry the teacher's signal
    assert m["groups_used"] == 2 and m["trainable_tokens"] == 8 * 5
    assert m["reverse_kl"] != 0
    assert m["teacher_agreement"] == pytest.approx(0.5, abs=0.05)  # half the completions repeat PATTERN
    assert sum("unreachable" in line and "the step waits" in line for line in lines) == 2
    scored = fake_teacher.requests[2:]
    assert {body["model"] for body in scored} == {"big@3"} and all(b["prompt_logprobs"] == 0 for b in scored)
    assert [len(body["prompt"]) for body in scored] == [1] * 8  # one row per request (vLLM CPU, trainer/teacher.py)
    assert (tmp_path / "ckpt" / "loop" / "teacher" / "step-00000001.safetensors").exists()
    assert "reverse KL" in lines[-1] and "teacher agrees 0.500" in lines[-1]


def test_a_worker_stopped_while_its_teacher_is_down_trains_nothing(
    db_url: str, tmp_path: Path, tiny_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("trainer.teacher.Teacher.backoff_s", 0.01)
    down = FakeTeacher(outages=10**9)
    db.upgrade(db_url)
    seed_groups(db_url, tiny_model, groups=2)
    engine = db.make_engine(db_url)
    try:
        config = {"groups_per_step": 2, "loss": "distill", "teacher": "big", "teacher_base_url": down.base_url}
        upsert_run(engine, "loop", config)
        stop = threading.Event()
        waits: list[str] = []

        def echo(line: str) -> None:
            if "the step waits" in line:
                waits.append(line)
                if len(waits) == 3:
                    stop.set()  # SIGTERM, as `trajgate train` does

        trainer = make_trainer(db_url, tmp_path, tiny_model, echo=echo)
        assert trainer.run(stop) == 0
        assert steps_after(engine, "loop") == [] and len(waits) == 3 and len(down.requests) == 3
    finally:
        engine.dispose()
        down.server.shutdown()
        down.server.server_close()
        while made:
            made.pop().close()


def test_the_step_line_of_a_distill_run() -> None:
    metrics = {
        "reward_mean": 0.5, "reward_std": 0.5, "groups_used": 2, "groups_dropped": 0, "tokens": 40,
        "trainable_tokens": 20, "loss": 0.25, "ratio_mean": 1.0, "ratio_max": 1.01, "log_ratio_abs_mean": 0.001,
        "clip_frac": 0.0, "reverse_kl": 1.5, "teacher_agreement": 0.25, "grad_norm": 0.5, "step_seconds": 1.0,
        "tokens_per_s": 40.0,
    }  # fmt: skip
    assert "reverse KL 1.5000 | teacher agrees 0.250" in format_step(1, metrics)
