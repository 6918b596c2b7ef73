"""bench/many_runs.py's fake vLLM admin answers the trainer's publisher as vLLM does, so the bench's publication
figures come from the publisher's real code path (the HTTP client of trainer.worker.publish)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.many_runs import SERVED, FakeVllm
from trainer.worker.publish import PublishError, VllmAdmin


@pytest.fixture
def fake() -> Iterator[FakeVllm]:
    server = FakeVllm()
    try:
        yield server
    finally:
        server.close()


def adapter_dir(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir()
    (path / "adapter_config.json").write_text("{}")
    return path


def test_the_publisher_loads_checks_reloads_and_unloads_through_the_fake(fake: FakeVllm, tmp_path: Path) -> None:
    admin = VllmAdmin(fake.base_url, timeout_s=10)
    assert admin.models() == {SERVED}
    admin.load("r1@1", adapter_dir(tmp_path, "one"))
    assert admin.check_answers("r1@1") >= 0
    # A name loaded twice is vLLM's 400: the admin unloads and loads it again, from the new path.
    admin.load("r1@1", adapter_dir(tmp_path, "again"))
    admin.load("r2@1", adapter_dir(tmp_path, "two"))
    assert admin.models() == {SERVED, "r1@1", "r2@1"}
    assert fake.adapters["r1@1"] == str(tmp_path / "again")
    assert (fake.loads, fake.peak_loaded) == (3, 2)
    admin.unload("r1@1")
    assert admin.models() == {SERVED, "r2@1"}
    with pytest.raises(PublishError, match="does not answer"):
        admin.check_answers("r1@1")  # vLLM's 404 for an adapter it does not serve


def test_a_path_without_an_adapter_is_refused_as_vllm_refuses_it(fake: FakeVllm, tmp_path: Path) -> None:
    with pytest.raises(PublishError, match="refused to load"):
        VllmAdmin(fake.base_url, timeout_s=10).load("r1@1", tmp_path / "missing")
    assert fake.adapters == {}
