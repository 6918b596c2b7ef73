"""The e2e tier talks to a real vLLM on CPU: the fakes are only as good as what it really sends.

Servers start once per session (~25 s each, plus a one-time venv build and model conversion on a
fresh machine). Set TRAJGATE_VLLM_BASE_URL to reuse a server already running, e.g. one started with
`python -m trainer.demo.vllm_cpu serve --model smollm2 --tools`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainer.demo.vllm_cpu import VllmServer, ensure_tiny_model, smollm2_server

E2E_DIR = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test under tests/e2e, so `-m "not e2e"` deselects the slow tier wholesale."""
    for item in items:
        if item.path.resolve().is_relative_to(E2E_DIR):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def vllm_model_name() -> str:
    return os.environ.get("TRAJGATE_VLLM_MODEL", "smollm2")


@pytest.fixture(scope="session")
def vllm_base_url() -> Iterator[str]:
    """SmolLM2-135M served as `smollm2` with the hermes tool parser, so `tools` requests work."""
    external = os.environ.get("TRAJGATE_VLLM_BASE_URL")
    if external:
        yield external.rstrip("/")
        return
    with smollm2_server() as server:
        yield server.base_url


@pytest.fixture(scope="session")
def vllm_tiny_base_url() -> Iterator[str]:
    """The tiny random Llama served as `tiny`: trainer tests load it, so vLLM must serve it too."""
    with VllmServer(ensure_tiny_model(), "tiny") as server:
        yield server.base_url
