"""Database fixtures: a real Postgres (TEST_DATABASE_URL, or a throwaway cluster) and SQLite.

Tests that matter take `db_url`, which runs them once on each backend.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from sqlalchemy import Engine

from gateway.store import db
from tests.support.fake_upstream import FakeUpstream
from tests.support.gateway_harness import RunningGateway, running_gateway
from tests.support.pgcluster import PgCluster, create_database, drop_database

if TYPE_CHECKING:
    from tests.support.scripted_server import Scripted


@pytest.fixture(scope="session")
def pg_server_url() -> Iterator[str]:
    """A Postgres server URL (its maintenance database); started for the session unless TEST_DATABASE_URL is set."""
    given = os.environ.get("TEST_DATABASE_URL")
    if given:
        yield given.replace("postgresql://", "postgresql+psycopg://", 1)
        return
    cluster = PgCluster()
    cluster.start()
    try:
        yield cluster.url()
    finally:
        cluster.destroy()


@pytest.fixture
def pg_url(pg_server_url: str) -> Iterator[str]:
    """A fresh, empty Postgres database for one test."""
    url = create_database(pg_server_url)
    try:
        yield url
    finally:
        drop_database(url)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'trajgate.db'}"


@pytest.fixture(params=["postgres", "sqlite"])
def db_url(request: pytest.FixtureRequest) -> str:
    """An empty database on each backend in turn."""
    return request.getfixturevalue("pg_url" if request.param == "postgres" else "sqlite_url")


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    """An engine on an empty database of each backend, at the newest schema."""
    db.upgrade(db_url)
    engine = db.make_engine(db_url)
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture(scope="session")
def upstream() -> Iterator[FakeUpstream]:
    """A vLLM-shaped upstream replaying responses recorded from real vLLM (tests/fixtures/vllm)."""
    fake = FakeUpstream().start()
    yield fake
    fake.stop()


@pytest.fixture
def gateway_settings(upstream: FakeUpstream, db_url: str, tmp_path: Path) -> dict[str, object]:
    """Settings for a gateway in front of the fake upstream, on each database backend."""
    upstream.mode = "replay"
    return {
        "database_url": db_url,
        "upstream_url": upstream.base_url,
        "base_model": "smollm2",
        "spool_dir": tmp_path / "spool",
    }


@pytest.fixture
def gateway(gateway_settings: dict[str, object]) -> Iterator[RunningGateway]:
    with running_gateway(**gateway_settings) as gw:
        yield gw


@pytest.fixture
def scripted() -> Iterator[Callable[[list[dict[str, Any]]], Scripted]]:
    """Starts scripted OpenAI-compatible servers for the example agents (tests/support/scripted_server.py), each with
    its replies; all are closed after the test."""
    from tests.support.scripted_server import Scripted  # it loads the tool agent example: only where a test asks

    servers: list[Scripted] = []

    def start(replies: list[dict[str, Any]]) -> Scripted:
        servers.append(Scripted(replies))
        return servers[-1]

    yield start
    for server in servers:
        server.close()
