"""Run the real gateway app under uvicorn on a free port, in-process, for tests that talk to it over HTTP."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from gateway.app import Gateway, create_app
from gateway.cli import uvicorn_config
from gateway.config import Settings, load_settings
from gateway.store import db
from tests.pgcluster import free_port


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
    deadline = time.monotonic() + 15
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("gateway did not start")
        time.sleep(0.01)
    try:
        yield RunningGateway(app, port)
    finally:
        app.begin_shutdown()  # as `trajgate serve` does on SIGTERM: live event streams end
        server.should_exit = True
        thread.join(30)
