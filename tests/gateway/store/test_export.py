"""`trajgate export` round trip on Postgres and SQLite: what comes out (JSON Lines and Parquet) is what was stored."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest

from gateway.cli import main
from gateway.store.db import make_engine
from gateway.store.export import iter_trajectories
from tests.support.fake_upstream import FakeUpstream
from tests.support.gateway_harness import RunningGateway
from tests.support.stored import stored_calls
from tests.support.trajectories import make_calls, reward

TRAIN = ["conv", "tools", "n2", "plain", "unrewarded"]
REWARDS = {"conv": 1.0, "tools": -0.5, "n2": 0.25, "plain": 0.0}


@pytest.fixture
def recorded(gateway: RunningGateway, upstream: FakeUpstream) -> RunningGateway:
    """A run with a multi-turn tool conversation, a tool call, n=2 choices, an unrewarded and an eval trajectory."""
    for name in ("conversation_turn1", "conversation_turn2_tool_call", "conversation_turn2_tool_result"):
        make_calls(gateway, upstream, ["conv"], group="g-exp", fixture=name)
    make_calls(gateway, upstream, ["tools"], group="g-exp", fixture="chat_tools")
    make_calls(gateway, upstream, ["n2"], group="g-exp", fixture="chat_n2_seeded")
    make_calls(gateway, upstream, ["plain", "unrewarded"], group="g-exp")
    make_calls(gateway, upstream, ["evaluated"], group="g-exp-eval", **{"X-Mode": "eval"})
    for trajectory, value in REWARDS.items():
        assert reward(gateway, trajectory, value, metrics={"len": 3}, metadata={"split": "a"}).status_code == 200
    assert reward(gateway, "evaluated", 0.5).status_code == 200
    return gateway


def expected(db_url: str, trajectory_id: str) -> list[dict[str, Any]]:
    """The calls as stored, in the export's terms; JSON has no -inf, so JSON Lines carries null for it."""
    out = []
    for call in stored_calls(db_url, trajectory_id):
        out.append(
            {
                "seq": call["seq"],
                "choice_index": call["choice_index"],
                "messages": call["request"]["messages"],
                "prompt_token_ids": call["prompt_token_ids"],
                "completion_token_ids": call["completion_token_ids"],
                "completion_logprobs": call["completion_logprobs"],
                "finish_reason": call["finish_reason"],
                "trainable": call["trainable"],
            }
        )
    return out


def check(db_url: str, records: list[dict[str, Any]], infinity_as_null: bool) -> None:
    assert [r["trajectory_id"] for r in records] == TRAIN  # oldest first, eval left out
    for record in records:
        assert (record["run"], record["group_id"], record["mode"]) == ("my-agent", "g-exp", "train")
        assert record["reward"] == REWARDS.get(record["trajectory_id"])
        rewarded = record["trajectory_id"] in REWARDS
        assert record["metrics"] == ({"len": 3.0} if rewarded else None)
        assert record["metadata"] == ({"split": "a"} if rewarded else None)
        calls = [{k: call[k] for k in expected(db_url, "conv")[0]} for call in record["calls"]]
        want = expected(db_url, record["trajectory_id"])
        if infinity_as_null:
            for call in want:
                call["completion_logprobs"] = [None if math.isinf(v) else v for v in call["completion_logprobs"]]
        assert calls == want
    conv = records[0]["calls"]
    assert [c["turn"] for c in conv] == [0, 1, 2] and conv[1]["tool_calls"][0]["function"]["name"]
    assert conv[0]["completion"] and conv[0]["policy_version"] == 0 and conv[0]["endpoint"] == "chat"
    assert [(c["turn"], c["choice_index"]) for c in records[2]["calls"]] == [(0, 0), (0, 1)]  # n=2: one turn


def test_export_round_trip(
    recorded: RunningGateway, db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {**os.environ, "TRAJGATE_DATABASE_URL": db_url}
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "export", "--run", "my-agent"], env=env, capture_output=True, check=True
    )
    lines = done.stdout.decode().splitlines()
    check(db_url, [json.loads(line) for line in lines], infinity_as_null=True)
    assert "5 trajectories" in done.stderr.decode()

    monkeypatch.setenv("TRAJGATE_DATABASE_URL", db_url)
    out = tmp_path / "run.parquet"
    assert main(["export", "--run", "my-agent", "--format", "parquet", "--output", str(out)]) == 0
    rows = pq.read_table(out).to_pylist()
    for row in rows:
        for key in ("metrics", "metadata"):
            row[key] = None if row[key] is None else json.loads(row[key])
        for call in row["calls"]:
            call["messages"] = json.loads(call["messages"])
            call["tool_calls"] = None if call["tool_calls"] is None else json.loads(call["tool_calls"])
    check(db_url, rows, infinity_as_null=False)
    # The call tree comes through Parquet as in JSON Lines (the recorded conversation's turns extend each other).
    tree = [[(c["parent"], c["branch"]) for c in json.loads(line)["calls"]] for line in lines]
    assert [[(c["parent"], c["branch"]) for c in row["calls"]] for row in rows] == tree
    assert any(parent is not None for calls in tree for parent, _ in calls)

    with_eval = tmp_path / "all.jsonl"
    assert main(["export", "--run", "my-agent", "--include-eval", "-o", str(with_eval)]) == 0
    exported = [json.loads(line) for line in with_eval.read_text().splitlines()]
    assert [(r["trajectory_id"], r["mode"], r["reward"]) for r in exported][-1] == ("evaluated", "eval", 0.5)
    assert main(["export", "--run", "no-such-run"]) == 1

    # The same records over HTTP (admin key), streamed as NDJSON.
    response = httpx.get(recorded.base_url + "/runs/my-agent/export")
    assert response.headers["content-type"].startswith("application/x-ndjson")
    assert response.text.splitlines() == lines


def test_export_pages_through_large_runs(recorded: RunningGateway, db_url: str) -> None:
    """Trajectories come a page at a time; page boundaries must neither drop nor repeat any."""
    engine = make_engine(db_url)
    try:
        whole = list(iter_trajectories(engine, "my-agent", include_eval=True))
        for page_size in (1, 2, 3):
            assert list(iter_trajectories(engine, "my-agent", include_eval=True, page_size=page_size)) == whole
    finally:
        engine.dispose()
    assert [t["trajectory_id"] for t in whole] == [*TRAIN, "evaluated"]


def test_parquet_without_pyarrow_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails as if it were not installed
    out = tmp_path / "never.parquet"
    assert main(["export", "--run", "r", "--format", "parquet", "--output", str(out)]) == 2
    assert "trajgate[export]" in capsys.readouterr().err and not out.exists()
