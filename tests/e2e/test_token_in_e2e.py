"""token_in against real vLLM CPU + SmolLM2: the OpenAI SDK tool loop, streamed and not, becomes one token sequence.

Train mode (temperature 1), so what the model says varies run to run: every assertion is derived from the recorded
ids. The loop feeds a tool result after turn 1 whether or not the model called the tool, so the merge of its turns
is checked either way.
"""

from __future__ import annotations

import uuid
from dataclasses import fields
from pathlib import Path

import httpx
import openai
import pytest

from gateway.store.lineage import EXTENDS
from tests.support.gateway_harness import running_gateway
from tests.support.stored import stored_calls
from tests.support.token_in_agent import RUN, tool_loop
from trainer.samples import CallData, GroupData, TrajectoryData, build_samples

CALL_FIELDS = [f.name for f in fields(CallData)]


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_tool_loop_is_one_sequence(vllm_base_url: str, tmp_path: Path, stream: bool) -> None:
    url = f"sqlite:///{tmp_path}/trajgate.db"
    group = f"g-{uuid.uuid4().hex[:8]}"
    trajectories = [f"{group}-{i}" for i in range(2)]
    with running_gateway(
        database_url=url, upstream_url=vllm_base_url, base_model="smollm2", spool_dir=tmp_path / "spool"
    ) as gateway:
        response = httpx.post(gateway.url + "/v1/runs", json={"name": RUN, "config": {"token_mode": "token_in"}})
        assert response.status_code in (200, 201), response.text
        for trajectory in trajectories:
            client = openai.OpenAI(base_url=f"{gateway.url}/g/{group}/t/{trajectory}/v1", api_key="x", max_retries=0)
            turns = tool_loop(client, stream, temperature=1.0)
            assert len(turns) == 3 and all(t["assistant"]["role"] == "assistant" for t in turns)
            assert all("<|im_end|>" not in (t["assistant"].get("content") or "") for t in turns)
        gateway.flush()

    data = []
    for reward, trajectory in enumerate(trajectories):
        calls = stored_calls(url, trajectory)
        assert len(calls) == 3 and all(c["trainable"] for c in calls), [c["untrainable_reason"] for c in calls]
        for before, after in zip(calls, calls[1:]):
            previous = before["prompt_token_ids"] + before["completion_token_ids"]
            assert after["prompt_token_ids"][: len(previous)] == previous
            assert len(after["prompt_token_ids"]) > len(previous)  # the bridge: tool result / user turn + prompt
        assert [c["merge_reason"] for c in calls] == ["first_call", EXTENDS, EXTENDS]
        assert [c["segment_reason"] for c in calls] == ["first_call", None, None]
        recorded = [CallData(**{f: c[f] for f in CALL_FIELDS}) for c in calls]
        data.append(TrajectoryData(trajectory, float(reward), recorded))

    batch = build_samples([GroupData(group, data)])
    for trajectory, recorded in zip(trajectories, data):
        (row,) = [r for r in batch.rows if r.trajectory_id == trajectory]  # one row per trajectory
        last = recorded.calls[-1]
        assert row.input_ids == last.prompt_token_ids + last.completion_token_ids
        trained = [t for t, m in zip(row.input_ids, row.loss_mask) if m]
        assert trained == [t for c in recorded.calls for t in c.completion_token_ids]
