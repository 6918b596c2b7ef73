"""The per-run gauges of /metrics (gateway.http.metrics): read at scrape time at most once per TTL, a series per
existing run only, and a database that cannot answer leaves them out without failing the page."""

from __future__ import annotations

import re

import pytest
from sqlalchemy.exc import OperationalError

from gateway.http.metrics import GatewayMetrics
from gateway.store.run_activity import RunGauges


def _runs(text: str) -> set[str]:
    return set(re.findall(r'^trajgate_run_step\{run="([^"]*)"\}', text, re.M))


def test_run_gauges_are_cached_bounded_to_existing_runs_and_survive_a_database_outage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [100.0]
    monkeypatch.setattr("gateway.http.metrics.time.monotonic", lambda: clock[0])
    runs = [
        RunGauges("a", {"open": 2, "ready": 1, "claimed": 0}, 3, 12.5, True, 3),
        RunGauges("b", {}, 0, None, False, 1),
    ]
    reads: list[int] = []

    def read() -> list[RunGauges]:
        reads.append(1)
        if runs and runs[0].run == "down":
            raise OperationalError("select", {}, Exception("connection refused"))
        return list(runs)

    metrics = GatewayMetrics()
    metrics.watch_runs(read, ttl_s=1.0, slots=6)
    text = metrics.render().decode()
    assert 'trajgate_run_groups{run="a",state="ready"} 1.0' in text
    assert 'trajgate_run_adapters_loaded{run="a"} 3.0' in text
    assert "trajgate_adapter_slots_used 4.0" in text and "trajgate_adapter_slots_total 6.0" in text
    assert 'trajgate_run_seconds_since_step{run="a"} 12.5' in text and 'seconds_since_step{run="b"}' not in text
    assert 'trajgate_run_trainer_held{run="a"} 1.0' in text and _runs(text) == {"a", "b"}

    runs.pop()  # run b deleted: its series go at the next read, not before the TTL is up
    clock[0] += 0.5
    assert _runs(metrics.render().decode()) == {"a", "b"} and len(reads) == 1
    clock[0] += 0.5
    assert _runs(metrics.render().decode()) == {"a"} and len(reads) == 2

    runs[0] = RunGauges("down", {}, 0, None, False, 0)
    clock[0] += 1.0
    text = metrics.render().decode()
    assert _runs(text) == set() and "# TYPE trajgate_run_step gauge" in text and len(reads) == 3
    assert "trajgate_adapter_slots_used" not in text  # unknown, not 0
    assert "trajgate_adapter_slots_total 6.0" in text
    assert "trajgate_requests" in text  # the rest of the page is still there
