"""vLLM adapter slots as the database counts them (gateway/store/adapter_slots.py): a claim holds a slot until it is
published, given back or unloaded, every run's rows count against one cap, and the runs list shows each run's."""

from __future__ import annotations

from sqlalchemy import Engine

from gateway.store.adapter_slots import adapters_held, claim_slot, pending_claims, release_slot
from gateway.store.runs import list_runs, run_view, upsert_run
from gateway.store.training import (
    current_policy_version,
    loaded_versions,
    mark_unloaded,
    publish_version,
    retire_version,
)


def test_a_slot_is_held_from_the_claim_until_the_version_is_unloaded(engine: Engine) -> None:
    for run in ("a", "b"):
        upsert_run(engine, run, {}, base_model="smollm2")
    assert claim_slot(engine, "a", 1, "a@1", "/c/a/1", 2).claimed
    assert pending_claims(engine, "a") == [(1, "a@1")]
    assert loaded_versions(engine, "a") == [] and current_policy_version(engine, "a") == 0  # not routed to yet
    assert claim_slot(engine, "a", 1, "a@1", "/c/a/1", 2).claimed  # the same version's claim is kept, not doubled
    publish_version(engine, "a", 1, "a@1", "/c/a/1")
    assert current_policy_version(engine, "a") == 1 and pending_claims(engine, "a") == []
    assert claim_slot(engine, "b", 1, "b@1", "/c/b/1", 2).claimed
    refused = claim_slot(engine, "a", 2, "a@2", "/c/a/2", 2)
    assert (refused.claimed, refused.used, refused.total) == (False, 2, 2)  # b's claim counts against a's cap
    release_slot(engine, "b", 1)
    assert claim_slot(engine, "a", 2, "a@2", "/c/a/2", 2).claimed
    publish_version(engine, "a", 2, "a@2", "/c/a/2")
    retire_version(engine, "a", 1)
    assert adapters_held(engine) == {"a": ["a@1", "a@2"]}  # retiring still holds its slot
    assert {run["name"]: run["adapters"] for run in list_runs(engine)} == {"a": ["a@1", "a@2"], "b": []}
    view = run_view(engine, "a")
    assert view is not None and view["adapters"] == ["a@1", "a@2"]
    mark_unloaded(engine, "a", 1)
    assert adapters_held(engine) == {"a": ["a@2"]}
    assert claim_slot(engine, "b", 1, "b@1", "/c/b/1", None).claimed  # no cap known: always
