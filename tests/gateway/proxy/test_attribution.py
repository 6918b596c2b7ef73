"""Attribution: headers, then path prefix, then API-key suffix; ids validated; a call without ids gets one."""

from __future__ import annotations

import os
import re

import pytest

from gateway.http.errors import GatewayError
from gateway.proxy.attribution import ID_RE, RandomIds, attribute, check_run, split_api_key, split_path
from gateway.proxy.turns import SeqClock


def test_headers_win_over_path_and_key() -> None:
    prefix = split_path("/g/pg/t/pt/v1/chat/completions")
    got = attribute({"x-trajectory-id": "ht", "x-group-id": "hg", "x-group-size": "4"}, prefix, "kg", "kt")
    assert (got.trajectory_id, got.group_id, got.group_size, got.generated) == ("ht", "hg", 4, False)


def test_path_forms() -> None:
    prefix = split_path("/g/grp-1/n/8/t/traj.1/v1/chat/completions")
    assert prefix is not None and prefix.rest == "/v1/chat/completions"
    got = attribute({}, prefix, "kg", "kt")
    assert (got.trajectory_id, got.group_id, got.group_size, got.mode) == ("traj.1", "grp-1", 8, "train")
    short = split_path("/t/only/v1/completions")
    assert short is not None and attribute({}, short, None, None).group_id == "only"
    evaluation = split_path("/eval/g/g1/t/t1/v1/chat/completions")
    assert evaluation is not None and attribute({}, evaluation, None, None).mode == "eval"
    assert split_path("/v1/chat/completions") is None


def test_api_key_suffix() -> None:
    assert split_api_key("sk-abc#g1/t1") == ("sk-abc", "g1", "t1")
    assert split_api_key("sk-abc#t1") == ("sk-abc", None, "t1")
    assert split_api_key("sk#with#hash#g/t") == ("sk#with#hash", "g", "t")
    assert split_api_key("plain") == ("plain", None, None)
    got = attribute({}, None, "g1", "t1")
    assert (got.trajectory_id, got.group_id) == ("t1", "g1")


def test_missing_ids_get_a_fresh_group_of_one() -> None:
    got = attribute({}, None, None, None)
    assert got.generated and got.trajectory_id == got.group_id and got.group_size == 1
    assert attribute({}, None, None, None).trajectory_id != got.trajectory_id


def test_a_coding_clis_session_is_its_trajectory_when_nothing_else_says() -> None:
    claude = {"x-claude-code-session-id": "0fe7ad68-c457-45f9-9a35-dc69b1c84720"}
    got = attribute(claude, None, None, None)
    assert (got.trajectory_id, got.group_id, got.group_size, got.generated) == (
        "0fe7ad68-c457-45f9-9a35-dc69b1c84720", "0fe7ad68-c457-45f9-9a35-dc69b1c84720", 1, False
    )
    assert attribute({"session-id": "01a21826-e958"}, None, None, None).trajectory_id == "01a21826-e958"  # Codex
    prefix = split_path("/g/task/t/run-1/v1/messages")
    assert attribute(claude, prefix, None, None).trajectory_id == "run-1"  # the client's own attribution wins
    assert attribute(claude, None, "g", "k-traj").trajectory_id == "k-traj"
    odd = attribute({"session-id": "not an id!"}, None, None, None)  # passed over, not refused
    assert odd.generated and odd.trajectory_id.startswith("tg-")


def test_trajectory_without_group_is_a_group_of_one() -> None:
    got = attribute({"x-trajectory-id": "t9"}, None, None, None)
    assert (got.group_id, got.group_size, got.generated) == ("t9", 1, False)


@pytest.mark.parametrize(
    "headers",
    [
        {"x-trajectory-id": "has space"},
        {"x-trajectory-id": "x" * 129},
        {"x-trajectory-id": ""},
        {"x-trajectory-id": "ok", "x-group-id": "bad/slash"},
        {"x-trajectory-id": "ok", "x-group-id": "g", "x-group-size": "0"},
        {"x-trajectory-id": "ok", "x-group-id": "g", "x-group-size": "four"},
        {"x-trajectory-id": "ok", "x-mode": "test"},
    ],
)
def test_invalid_attribution_is_a_400(headers: dict[str, str]) -> None:
    with pytest.raises(GatewayError) as info:
        attribute(headers, None, None, None)
    assert info.value.status == 400


def test_run_names() -> None:
    assert check_run("email-agent") == "email-agent"
    assert check_run("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    for bad in (None, 3, "", "a b", "x" * 129, ".", "..", "a/b/..", "../b", "/a", "a/", "a//b", "a/./b"):
        with pytest.raises(GatewayError) as info:
            check_run(bad)
        assert info.value.status == 400


def test_seq_clock_is_strictly_increasing_even_within_one_clock_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = SeqClock()
    monkeypatch.setattr("gateway.proxy.turns.time.time_ns", lambda: 5_000)
    assert [clock.next() for _ in range(3)] == [5_000, 5_001, 5_002]
    monkeypatch.setattr("gateway.proxy.turns.time.time_ns", lambda: 9_000)
    assert clock.next() == 9_000


def test_fresh_trajectory_ids_are_random_and_take_one_system_call_per_fill(monkeypatch: pytest.MonkeyPatch) -> None:
    drawn: list[int] = []
    real = os.urandom

    def urandom(size: int) -> bytes:
        drawn.append(size)
        return real(size)

    monkeypatch.setattr("gateway.proxy.attribution.os.urandom", urandom)
    ids = RandomIds(per_fill=4)
    made = [ids() for _ in range(9)]
    assert drawn == [64, 64, 64]  # 16 bytes an id, four ids a fill
    assert len(set(made)) == 9 and all(re.fullmatch(r"[0-9a-f]{32}", i) for i in made)
    fresh = [attribute({}, None, None, None).trajectory_id for _ in range(300)]
    assert len(set(fresh)) == 300 and all(ID_RE.match(f) and f.startswith("tg-") and len(f) == 35 for f in fresh)
