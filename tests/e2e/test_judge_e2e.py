"""The LLM judge against real vLLM on CPU: an agent's group of four recorded through the gateway, then judged by
SmolLM2-135M (`hosted_vllm/smollm2`, through litellm when it is installed, else the built-in client). The model is
tiny: guided JSON decoding (response_format json_schema) is what makes its answer well-formed."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.judge.providers import litellm_installed
from tests.support.gateway_harness import RunningGateway, running_gateway

GROUP = "e2e-judge"
RUN = "judge-e2e"


@pytest.fixture
def judged_gateway(vllm_base_url: str, vllm_model_name: str, pg_url: str, tmp_path: Path) -> Iterator[RunningGateway]:
    with running_gateway(
        database_url=pg_url, upstream_url=vllm_base_url, base_model=vllm_model_name, spool_dir=tmp_path / "spool"
    ) as gw:
        yield gw


def test_judge_a_group_of_four_with_real_vllm(
    judged_gateway: RunningGateway, vllm_base_url: str, vllm_model_name: str
) -> None:
    gw = judged_gateway
    judge = {"model": f"hosted_vllm/{vllm_model_name}", "api_base": vllm_base_url, "backoff_s": 0.5}
    created = httpx.post(f"{gw.base_url}/runs", json={"name": RUN, "config": {"judge": judge}}, timeout=30)
    assert created.status_code == 201, created.text

    # The agent: four attempts at the same task, sampled, so their answers differ.
    ids = [f"ej-{i}" for i in range(1, 5)]
    for i, trajectory_id in enumerate(ids):
        client = openai.OpenAI(base_url=f"{gw.url}/g/{GROUP}/n/4/t/{trajectory_id}/v1", api_key="sk", max_retries=0)
        client.chat.completions.create(
            model=RUN,
            messages=[
                {"role": "system", "content": "You are a geography tutor. Answer in one short sentence."},
                {"role": "user", "content": "What is the capital of France?"},
            ],
            max_tokens=24,
            temperature=1.0,
            seed=i,
        )

    started = time.perf_counter()
    response = httpx.post(f"{gw.base_url}/groups/{GROUP}/judge", timeout=600)
    seconds = time.perf_counter() - started
    assert response.status_code == 200, response.text
    body = response.json()
    print(f"\njudged a group of 4 with {body['model']} via {body['client']} in {seconds:.1f}s "
          f"({body['attempts']} attempt(s); failed: {body['failed_attempts']})")  # fmt: skip
    for item in body["data"]:
        print(f"  {item['trajectory_id']}: {item['reward']:.2f}  {item['explanation']}")
    assert body["client"] == ("litellm" if litellm_installed() else "builtin")
    assert [item["trajectory_id"] for item in body["data"]] == ids
    # Guided decoding fixes the shape and the range; what the explanation says (even " ") is up to the model.
    assert all(0.0 <= item["reward"] <= 1.0 and isinstance(item["explanation"], str) for item in body["data"])
    assert all("\n" not in item["explanation"] for item in body["data"])  # kept to one line
    assert (body["group_state"], body["group_ready"]) == ("ready", True)
    assert body["truncation"]["truncated"] is False

    group = httpx.get(f"{gw.base_url}/groups/{GROUP}", timeout=30).json()
    assert (group["state"], group["rewarded"], group["size"]) == ("ready", 4, 4)
    for trajectory in group["trajectories"]:
        assert trajectory["metrics"]["judge_score"] == trajectory["reward"]
    view = httpx.get(f"{gw.base_url}/trajectories/ej-1", timeout=30).json()
    assert view["metadata"]["judge"]["explanation"] == body["data"][0]["explanation"]
    assert view["metadata"]["judge"]["model"] == f"hosted_vllm/{vllm_model_name}"
