"""The whole loop on real vLLM CPU with the tiny model: calls through the gateway, rewards, trainer steps,
adapters loaded into vLLM as run@step and routed to by the gateway; a trainer killed mid-step loses nothing."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.runs.settings import load_settings
from gateway.store import db
from gateway.store.runs import steps_after
from gateway.store.training import group_states
from tests.support.gateway_harness import RunningGateway, running_gateway
from tests.support.waiting import OutputLines, wait_until
from trainer.demo.vllm_cpu import ensure_tiny_model
from trainer.worker.loop import Trainer, TrainerOptions

RUN = "loop-e2e"
KILL_RUN = "loop-kill"
PROMPTS = ["Tell me a color.", "Name an animal.", "Say a number.", "Pick a fruit."]


@pytest.fixture
def stack(vllm_tiny_base_url: str, pg_url: str, tmp_path: Path) -> Iterator[tuple[RunningGateway, str]]:
    with running_gateway(
        database_url=pg_url, upstream_url=vllm_tiny_base_url, base_model="tiny", spool_dir=tmp_path / "spool"
    ) as gw:
        for run in (RUN, KILL_RUN):
            response = httpx.post(
                gw.base_url + "/runs",
                json={
                "name": run,
                "base_model": "tiny",
                "base_weights": str(ensure_tiny_model()),
                "config": {
                    "groups_per_step": 2,
                    "learning_rate": 5e-3,
                    "loss": "cispo",
                    "sampling": {"temperature": 1.0, "max_tokens": 8},
                },
            },
            )
            assert response.status_code in (200, 201), response.text
        yield gw, pg_url


def play_groups(gw: RunningGateway, prefix: str, run: str = RUN, groups: int = 2, size: int = 4) -> list[str]:
    """Agents answer through the gateway (path-prefix attribution); a reward with spread is posted per answer."""
    rng = random.Random(prefix)
    versions = []
    for g in range(groups):
        group = f"{prefix}-g{g}"
        for t in range(size):
            client = openai.OpenAI(base_url=f"{gw.url}/g/{group}/n/{size}/t/{group}-t{t}/v1", api_key="k", max_retries=0)
            reply = client.chat.completions.with_raw_response.create(
                model=run, messages=[{"role": "user", "content": PROMPTS[g % len(PROMPTS)]}]
            )
            versions.append(reply.headers["x-policy-version"])
            assert httpx.post(
                f"{gw.base_url}/trajectories/{group}-t{t}/reward", json={"reward": float(t % 2) + rng.random() / 10}
            ).status_code == 200
    return versions


def trainer_for(url: str, tmp_path: Path, upstream: str, **options: object) -> Trainer:
    settings = load_settings(_env_file=None, database_url=url, checkpoint_dir=tmp_path / "ckpt", upstream_url=upstream)
    return Trainer(settings, TrainerOptions(run=RUN, backend="hf", device="cpu", poll_s=0.2, **options))


def vllm_models(upstream: str) -> set[str]:
    return {m["id"] for m in httpx.get(upstream + "/models").json()["data"]}


def greedy_logprobs(upstream: str, model: str) -> list[float]:
    response = httpx.post(
        upstream + "/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": PROMPTS[0]}],
            "max_tokens": 4,
            "temperature": 0,
            "logprobs": True,
        },
        timeout=120,
    ).json()
    return [entry["logprob"] for entry in response["choices"][0]["logprobs"]["content"]]


def wait_for_version(gw: RunningGateway, version: int, timeout_s: float = 30) -> None:
    wait_until(lambda: gw.app.state.router.resolve(RUN, "tiny").version >= version, timeout_s,
               f"the gateway to route {RUN} to version {version}")  # fmt: skip


def test_two_steps_publish_adapters_that_the_gateway_routes_to(
    stack: tuple[RunningGateway, str], vllm_tiny_base_url: str, tmp_path: Path
) -> None:
    gw, url = stack
    assert set(play_groups(gw, "a")) == {"0"}
    with trainer_for(url, tmp_path, vllm_tiny_base_url, max_steps=1) as trainer:
        assert trainer.run() == 1
        assert f"{RUN}@1" in vllm_models(vllm_tiny_base_url)
        wait_for_version(gw, 1)

        assert set(play_groups(gw, "b")) == {"1"}  # calls after publication are served by the adapter
        trainer.options.max_steps = 1
        assert trainer.run() == 1
    served = vllm_models(vllm_tiny_base_url)
    assert {f"{RUN}@1", f"{RUN}@2"} <= served

    engine = db.make_engine(url)
    try:
        steps = steps_after(engine, RUN)
    finally:
        engine.dispose()
    first = steps[0]["metrics"]
    # Fresh data is on-policy: the trainer's fp32 logprobs match vLLM's bf16 ones up to precision.
    print(f"step 1 IS ratio mean {first['ratio_mean']:.4f} max {first['ratio_max']:.3f}; swap {first['swap_seconds']:.1f}s")
    assert abs(first["ratio_mean"] - 1) < 0.05
    assert steps[1]["metrics"]["policy_version"] == 1 and steps[1]["metrics"]["publish_error"] is None
    # The adapter really changes the policy: its logprobs differ from the base model's on the same prompt.
    base, tuned = greedy_logprobs(vllm_tiny_base_url, "tiny"), greedy_logprobs(vllm_tiny_base_url, f"{RUN}@2")
    assert base != tuned


def test_killed_trainer_loses_and_duplicates_nothing(
    stack: tuple[RunningGateway, str], vllm_tiny_base_url: str, tmp_path: Path
) -> None:
    gw, url = stack
    play_groups(gw, "k", run=KILL_RUN)
    env = {
        **os.environ,
        "TRAJGATE_DATABASE_URL": url,
        "TRAJGATE_UPSTREAM_URL": vllm_tiny_base_url,
        "TRAJGATE_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
    }
    command = [sys.executable, "-m", "gateway.cli", "train", "--run", KILL_RUN, "--backend", "hf", "--device", "cpu",
               "--steps", "1", "--lease-s", "3", "--run-lease-s", "3", "--poll-s", "0.2"]
    victim = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = OutputLines(victim)
    engine = db.make_engine(url)
    try:

        def mid_step() -> bool:  # it holds the groups
            assert victim.poll() is None, f"the trainer exited ({victim.returncode}) before claiming:\n{output.text()}"
            return "claimed" in group_states(engine, KILL_RUN).values()

        wait_until(mid_step, 120, "the trainer to claim the groups")
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        assert steps_after(engine, KILL_RUN) == []

        survivor = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert survivor.returncode == 0, survivor.stdout + survivor.stderr
        steps = steps_after(engine, KILL_RUN)
        states = group_states(engine, KILL_RUN)
    finally:
        engine.dispose()
    assert [s["step"] for s in steps] == [1]  # one step, committed once
    assert sorted(states.values()) == ["trained", "trained"]  # the killed step's groups were trained, once
    assert sorted(p.name for p in (tmp_path / "ckpt" / KILL_RUN).iterdir()) == ["00001"]
    assert f"{KILL_RUN}@1" in vllm_models(vllm_tiny_base_url)
