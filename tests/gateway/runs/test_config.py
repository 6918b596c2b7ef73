"""Configuration: sensible defaults, and a bad value fails with one line that names the variable."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gateway.runs.settings import ConfigError, load_settings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    for name in list(os.environ):
        if name.startswith("TRAJGATE_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)  # no stray .env


def test_defaults() -> None:
    settings = load_settings()
    assert settings.database_url == "sqlite:///trajgate.db"
    assert settings.is_sqlite
    assert settings.agent_keys == []
    assert settings.admin_key is None


def test_env_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAJGATE_DATABASE_URL", "postgres://u@db:5432/tg")
    monkeypatch.setenv("TRAJGATE_AGENT_KEYS", " k1, k2 ,")
    monkeypatch.setenv("TRAJGATE_ADMIN_KEY", "")
    monkeypatch.setenv("TRAJGATE_UPSTREAM_URL", "http://vllm:8000/v1/")
    settings = load_settings()
    assert settings.database_url == "postgresql+psycopg://u@db:5432/tg"
    assert [k.get_secret_value() for k in settings.agent_keys] == ["k1", "k2"]
    assert settings.admin_key is None
    assert settings.upstream_url == "http://vllm:8000/v1"
    assert "k1" not in repr(settings)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("TRAJGATE_DATABASE_URL", "mysql://x"),
        ("TRAJGATE_UPSTREAM_URL", "vllm:8000"),
        ("TRAJGATE_AGENT_KEYS", "good,bad#key"),
    ],
)
def test_bad_value_names_the_variable(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        load_settings()
    message = str(info.value)
    assert name in message
    assert "\n" not in message


def test_cli_reports_bad_config_in_one_line() -> None:
    env = {**os.environ, "TRAJGATE_DATABASE_URL": "mysql://nope"}
    result = subprocess.run([sys.executable, "-m", "gateway.cli", "migrate"], env=env, capture_output=True, text=True)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "TRAJGATE_DATABASE_URL" in lines[0]
    assert "Traceback" not in result.stderr


def test_cli_help_lists_commands() -> None:
    result = subprocess.run([sys.executable, "-m", "gateway.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    assert "migrate" in result.stdout and "TRAJGATE_DATABASE_URL" in result.stdout
