"""Two runs trained by ONE `trajgate train --runs` process on real vLLM CPU (the tiny model): each run's step is
published as its own adapter, and a call through the gateway for each run is answered by that run's adapter.

Nothing here depends on what the model generates: the answers are checked by the adapter vLLM says served them
(the response's `model`, recorded with the call) and the adapter directory vLLM lists for each name."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.store import db
from gateway.store.runs import steps_after
from tests.support.gateway_harness import RunningGateway, running_gateway
from tests.support.stored import stored_calls
from tests.support.waiting import wait_until
from trainer.demo.vllm_cpu import ensure_tiny_model

RUNS = ("runs-a", "runs-b")
# Adapter slots: vLLM needs --max-loras >= the sum over runs of keep_adapters + 1 (a new version loads before the
# old one is unloaded). The session's tiny vLLM has VllmServer's default 4: two runs keeping one adapter each.
KEEP_ADAPTERS = 1
VLLM_MAX_LORAS = 4


@pytest.fixture
def gateway(vllm_tiny_base_url: str, pg_url: str, tmp_path: Path) -> Iterator[RunningGateway]:
    with running_gateway(
        database_url=pg_url, upstream_url=vllm_tiny_base_url, base_model="tiny", spool_dir=tmp_path / "spool"
    ) as gw:
        for run in RUNS:
            response = httpx.post(
                gw.base_url + "/runs",
                json={
                    "name": run,
                    "base_model": "tiny",
                    "base_weights": str(ensure_tiny_model()),
                    "config": {
                        "groups_per_step": 1,
                        "learning_rate": 5e-3,
                        "sampling": {"temperature": 1.0, "max_tokens": 4},
                    },
                },
            )
            assert response.status_code in (200, 201), response.text
        yield gw


def call(gw: RunningGateway, run: str, group: str, trajectory: str, size: int) -> tuple[str, str]:
    """One chat call of `run` through the gateway, attributed by path prefix: (the policy version the gateway
    routed it to, the model vLLM says answered)."""
    client = openai.OpenAI(base_url=f"{gw.url}/g/{group}/n/{size}/t/{trajectory}/v1", api_key="k", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=run, messages=[{"role": "user", "content": f"Say something, {run}."}]
    )
    return raw.headers["x-policy-version"], raw.parse().model


def test_one_trainer_process_trains_and_publishes_two_runs_each_served_by_its_own_adapter(
    gateway: RunningGateway, vllm_tiny_base_url: str, pg_url: str, tmp_path: Path
) -> None:
    gw = gateway
    for run in RUNS:  # a group of four per run, rewards with spread so none is dropped
        for t in range(4):
            assert call(gw, run, f"{run}-g0", f"{run}-g0-t{t}", 4) == ("0", "tiny")
            reward = httpx.post(f"{gw.base_url}/trajectories/{run}-g0-t{t}/reward", json={"reward": float(t % 2)})
            assert reward.status_code == 200, reward.text

    checkpoints = tmp_path / "ckpt"
    env = {
        **os.environ,
        "TRAJGATE_DATABASE_URL": pg_url,
        "TRAJGATE_UPSTREAM_URL": vllm_tiny_base_url,
        "TRAJGATE_CHECKPOINT_DIR": str(checkpoints),
        "TRAJGATE_VLLM_MAX_LORAS": str(VLLM_MAX_LORAS),
    }
    trainer = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "train", "--runs", ",".join(RUNS), "--backend", "hf", "--device",
         "cpu", "--steps", "1", "--keep-adapters", str(KEEP_ADAPTERS), "--poll-s", "0.2"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = trainer.stdout + trainer.stderr
    assert trainer.returncode == 0, output
    # One process trained both: its summary names both runs, and each run's lines carry its prefix.
    assert "trajgate train: 2 step(s) done; run 'runs-a' is at step 1, run 'runs-b' is at step 1" in output
    for run in RUNS:
        assert f"[{run}] published {run}@1" in output, output

    engine = db.make_engine(pg_url)
    try:
        for run in RUNS:
            (step,) = steps_after(engine, run)
            assert step["metrics"]["publish_error"] is None and step["metrics"]["swap_seconds"] >= 0
    finally:
        engine.dispose()

    # vLLM serves each run's adapter under its own name, each from that run's own step-1 checkpoint.
    listed = {m["id"]: m for m in httpx.get(vllm_tiny_base_url + "/models").json()["data"]}
    for run in RUNS:
        assert f"{run}@1" in listed, sorted(listed)
        assert Path(listed[f"{run}@1"]["root"]).resolve() == (checkpoints / run / "00001").resolve()

    for run in RUNS:
        wait_until(lambda run=run: gw.app.state.router.resolve(run, "tiny").version == 1, 30,
                   f"the gateway to route {run} to version 1")  # fmt: skip
    for run in RUNS:
        trajectory = f"{run}-after"
        # Routed to the run's version 1, and vLLM names the adapter that answered.
        assert call(gw, run, f"{run}-g1", trajectory, 1) == ("1", f"{run}@1")
        gw.flush()
        (recorded,) = stored_calls(pg_url, trajectory)
        assert (recorded["run"], recorded["policy_version"]) == (run, 1)
        assert recorded["response"]["model"] == f"{run}@1"
