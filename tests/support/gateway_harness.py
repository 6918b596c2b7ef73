"""The real gateway for tests that talk to it over HTTP: in-process under uvicorn on a free port, or as the
`trajgate serve` process users run."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn

from gateway.app import Gateway, create_app
from gateway.cli import uvicorn_config
from gateway.runs.settings import Settings, load_settings
from gateway.store import db
from tests.support.pgcluster import free_port
from tests.support.waiting import OutputLines, wait_until


class RunningGateway:
    def __init__(self, app: Gateway, port: int) -> None:
        self.app = app
        self.port = port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def flush(self) -> None:
        assert self.app.state.writer.flush(10), "writer did not flush in time"


@contextmanager
def running_gateway(**overrides: object) -> Iterator[RunningGateway]:
    """Migrate the database, start the gateway, yield it, and shut it down gracefully (flushing records)."""
    settings: Settings = load_settings(_env_file=None, **overrides)  # a developer's .env must not leak in
    db.upgrade(settings.database_url)
    app = create_app(settings)
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, settings, "127.0.0.1", port, "warning"))
    thread = threading.Thread(target=server.run, name="gateway", daemon=True)
    thread.start()

    def started() -> bool:
        if not thread.is_alive():
            raise RuntimeError("gateway did not start")
        return server.started

    wait_until(started, 30, "the gateway to start", interval_s=0.01)
    try:
        yield RunningGateway(app, port)
    finally:
        app.begin_shutdown()  # as `trajgate serve` does on SIGTERM: live event streams end
        server.should_exit = True
        thread.join(30)


def start_serve(
    upstream_url: str, database_url: str, spool_dir: Path, *args: str
) -> tuple[subprocess.Popen[str], OutputLines, int]:
    """`trajgate serve [args]` as users run it, on a free port, once it answers /health; its output is drained as
    it comes (a pipe nobody reads would block it). The caller stops the process."""
    db.upgrade(database_url)
    port = free_port()
    env = {
        **os.environ,
        "TRAJGATE_DATABASE_URL": database_url,
        "TRAJGATE_UPSTREAM_URL": upstream_url,
        "TRAJGATE_BASE_MODEL": "smollm2",
        "TRAJGATE_SPOOL_DIR": str(spool_dir),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--log-level", "warning", *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    output = OutputLines(process)

    def healthy() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"gateway exited ({process.returncode}):\n{output.finish()}")
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(healthy, 30, "the gateway to answer /health")
    except BaseException:
        process.kill()
        process.wait()
        raise
    return process, output, port
