"""The real Claude Code and Codex CLIs through the gateway, in front of real vLLM CPU + SmolLM2.

Each CLI runs one non-interactive task (`claude -p`, `codex exec`) with the gateway as its API. What is asserted is
the gateway's part, whatever the 135M model writes: every call the CLI made was answered 200 and recorded with its
exact prompt and completion ids and one logprob per completion token, under the trajectory the CLI's run maps to
(Claude Code: its session id, which it prints; Codex: the base URL's /g/.../t/... prefix), and that trajectory takes a
reward. A CLI may stop on the model's output limit (SmolLM2 rarely ends on its own within a few dozen tokens); its
calls are answered all the same, so that ending counts as a run.

The CLIs are installed from npm into the cache dir, at the versions the parity corpus (tests/fixtures/parity) was
captured with. Claude Code's system prompt and tools come to ~3k SmolLM2 tokens and Codex's to ~4.5k, so vLLM serves
an 8k context here (TRAJGATE_VLLM_BASE_URL, when set, must serve at least that).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.gateway_harness import RunningGateway, running_gateway
from tests.support.stored import stored_calls
from trainer.demo.vllm_cpu import cache_dir, smollm2_server

CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.197"
CODEX = "@openai/codex@0.171.0"
MAX_TOKENS = 48  # a few seconds per call on CPU
CLI_TIMEOUT_S = 180
# How Claude Code says it stopped on the output limit, every call answered (Codex exits 0 then).
OUTPUT_LIMIT = re.compile(r"response exceeded the \d+ output token maximum")


@pytest.fixture(scope="module")
def clis() -> Path:
    """The CLIs' bin directory, npm-installed once into the cache dir."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.fail("npm is not installed: the Claude Code and Codex CLIs come from npm (.ci/run installs it)")
    prefix = cache_dir() / "clis"
    bin_dir = prefix / "node_modules" / ".bin"
    versions = prefix / "versions.txt"
    if not versions.exists() or versions.read_text() != f"{CLAUDE_CODE} {CODEX}":
        subprocess.run(
            [npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", CLAUDE_CODE, CODEX],
            check=True, timeout=600, capture_output=True,
        )  # fmt: skip
        versions.write_text(f"{CLAUDE_CODE} {CODEX}")
    return bin_dir


@pytest.fixture(scope="module")
def vllm_8k() -> Iterator[str]:
    external = os.environ.get("TRAJGATE_VLLM_BASE_URL")
    if external:
        yield external.rstrip("/")
        return
    with smollm2_server(max_model_len=8192) as server:
        yield server.base_url


@pytest.fixture
def gateway(vllm_8k: str, tmp_path: Path) -> Iterator[tuple[RunningGateway, str]]:
    url = f"sqlite:///{tmp_path}/trajgate.db"
    with running_gateway(
        database_url=url, upstream_url=vllm_8k, base_model="smollm2", spool_dir=tmp_path / "spool"
    ) as gw:
        yield gw, url


def run_cli(command: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        command, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=CLI_TIMEOUT_S
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0 or OUTPUT_LIMIT.search(output), output[-3000:]
    return result


def assert_recorded_and_rewardable(gateway: RunningGateway, db_url: str, trajectory: str, endpoint: str) -> None:
    gateway.flush()
    calls = stored_calls(db_url, trajectory)
    assert calls, f"no call recorded under {trajectory}"
    for call in calls:
        assert (call["endpoint"], call["status_code"]) == (endpoint, 200), call["error"]
        assert call["prompt_token_ids"] and call["completion_token_ids"]
        assert len(call["completion_logprobs"]) == len(call["completion_token_ids"])
        assert call["trainable"], call["untrainable_reason"]
    reward = httpx.post(f"{gateway.base_url}/trajectories/{trajectory}/reward", json={"reward": 1.0}, timeout=30)
    assert reward.status_code == 200, reward.text


def cli_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A scratch HOME, so no user's settings or credentials reach the CLI."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TMPDIR", "SSL_CERT_FILE")}
    return {**keep, "HOME": str(home), "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", **extra}


def test_claude_code_runs_through_the_gateway(
    clis: Path, gateway: tuple[RunningGateway, str], tmp_path: Path
) -> None:
    gw, db_url = gateway
    env = cli_env(
        tmp_path,
        ANTHROPIC_BASE_URL=gw.url,
        ANTHROPIC_API_KEY="sk-anything",
        CLAUDE_CODE_MAX_OUTPUT_TOKENS=str(MAX_TOKENS),
    )
    command = [str(clis / "claude"), "-p", "Reply with the single word: hi", "--model", "smollm2"]
    result = run_cli([*command, "--output-format", "json"], env, tmp_path)
    # The run's session id is its trajectory (X-Claude-Code-Session-Id on every call; no prefix was given).
    session = json.loads(result.stdout)["session_id"]
    assert_recorded_and_rewardable(gw, db_url, session, "messages")


def test_codex_exec_runs_through_the_gateway(
    clis: Path, gateway: tuple[RunningGateway, str], tmp_path: Path
) -> None:
    gw, db_url = gateway
    # Codex has no output-token setting: the run caps it (max_tokens changes no distribution: still trainable).
    run = {"name": "codex-e2e", "config": {"sampling": {"max_tokens": MAX_TOKENS}}}
    httpx.post(f"{gw.base_url}/runs", json=run, timeout=30).raise_for_status()
    trajectory = f"codex-{uuid.uuid4().hex[:8]}"
    codex_home = tmp_path / "codex"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(
        'model = "codex-e2e"\nmodel_provider = "trajgate"\n\n[model_providers.trajgate]\nname = "trajgate"\n'
        f'base_url = "{gw.url}/g/codex-task/n/1/t/{trajectory}/v1"\nenv_key = "TRAJGATE_KEY"\nwire_api = "responses"\n'
    )
    env = cli_env(tmp_path, CODEX_HOME=str(codex_home), TRAJGATE_KEY="sk-anything")
    command = [str(clis / "codex"), "exec", "--skip-git-repo-check", "Reply with the single word: hi"]
    run_cli(command, env, tmp_path)
    assert_recorded_and_rewardable(gw, db_url, trajectory, "responses")
