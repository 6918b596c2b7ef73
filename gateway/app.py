"""The gateway as one ASGI app: model calls go straight to the proxy's hot path, everything else to FastAPI.

Attribution path prefixes (`/g/{group}/t/{trajectory}/v1/...`) are taken off here, so `/v1/models` and friends
also work under a base_url that carries them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import asdict

from fastapi import FastAPI
from sqlalchemy.exc import SQLAlchemyError
from starlette.types import Receive, Scope, Send

from gateway.api import judge_api, read_api, rewards_api, runs_api
from gateway.api.service import install_error_handlers, router
from gateway.edge import api_messages, api_responses
from gateway.edge.api_messages import MessagesApi
from gateway.edge.api_responses import ResponsesAPI
from gateway.http.auth import Auth
from gateway.http.deps import GatewayState
from gateway.http.errors import GatewayError
from gateway.http.metrics import GatewayMetrics
from gateway.proxy.attribution import split_path
from gateway.proxy.hot_path import ENDPOINTS, Proxy, send_json
from gateway.proxy.routing import PolicyRouter
from gateway.recorder.heartbeat import Peers
from gateway.recorder.threads import name_os_thread
from gateway.recorder.writer import RecordWriter
from gateway.recorder.writer_process import WriterProcess
from gateway.runs.settings import Settings
from gateway.store.db import make_engine
from gateway.store.run_activity import run_gauges
from gateway.ui import pages as ui
from gateway.ui.token_text import TokenTextCache

log = logging.getLogger("trajgate.gateway")

# How often the in-memory routing table (policy versions, sampling overrides) is reloaded from the database.
ROUTE_REFRESH_S = 1.0


def build_state(settings: Settings) -> GatewayState:
    engine = make_engine(settings.database_url)
    process = None
    if settings.writer_process and engine.dialect.name == "postgresql":
        process = WriterProcess(engine.url.render_as_string(hide_password=False), settings.writer_nice)
    writer = RecordWriter(
        engine,
        settings.spool_dir,
        queue_size=settings.writer_queue_size,
        batch_size=settings.writer_batch_size,
        queue_bytes=settings.writer_queue_bytes,
        fsync_interval_s=settings.wal_fsync_ms / 1000,
        process=process,
        slice_s=settings.writer_slice_us / 1e6,
        pause_s=settings.writer_pause_us / 1e6,
        nice=settings.writer_nice,
        idle=settings.writer_idle,
        # (read by the writer thread once started, after `proxy` below exists)
        calls_in_flight=lambda: sum(replica.in_flight for replica in proxy.replicas.all),
        quiet_for=lambda: time.monotonic() - proxy.replicas.touched,
    )
    policy_router = PolicyRouter(settings.base_model)
    auth = Auth(settings.agent_keys, settings.admin_key)
    metrics = GatewayMetrics()
    metrics.watch_writer(lambda: asdict(writer.stats()))
    metrics.watch_runs(lambda: run_gauges(engine), slots=settings.vllm_max_loras)
    proxy = Proxy(
        upstream_urls=settings.upstream_urls,
        upstream_api_key=settings.upstream_api_key.get_secret_value() if settings.upstream_api_key else None,
        upstream_timeout_s=settings.upstream_timeout_s,
        max_body_bytes=settings.max_body_bytes,
        auth=auth,
        router=policy_router,
        writer=writer,
        metrics=metrics,
        engine=engine,
        token_state_wait_s=settings.token_state_wait_s,
        admission_poll_s=settings.admission_poll_s,
        token_in_templates=settings.token_in_templates,
    )
    metrics.watch_replicas(lambda: [(r.url, r.healthy, r.in_flight) for r in proxy.replicas.all])
    responses = ResponsesAPI(proxy, engine, settings.token_state_wait_s, settings.responses_memory_bytes)
    metrics.watch_responses(lambda: responses.kept_count, lambda: responses.kept_bytes)
    messages = MessagesApi(proxy)
    peers = Peers(
        engine, writer, metrics, settings.peer_poll_s, settings.peer_alive_s, settings.peer_wait_s,
        settings.writer_wait_s, lambda: policy_router.read_at,
    )  # fmt: skip
    proxy.token_in.peers = peers
    return GatewayState(
        settings, engine, writer, policy_router, auth, metrics, proxy, responses, messages, TokenTextCache(), peers
    )


class Gateway:
    """The ASGI entry point: a dispatcher in front of the hot path and the FastAPI app."""

    def __init__(self, settings: Settings) -> None:
        self.state = build_state(settings)
        self.api = FastAPI(title="trajgate", lifespan=self._lifespan, docs_url="/docs", redoc_url=None)
        self.api.state.gateway = self.state
        for module in (
            router, rewards_api.router, read_api.router, runs_api.router, judge_api.router, api_responses.router,
            ui.router,
        ):  # fmt: skip
            self.api.include_router(module)
        install_error_handlers(self.api)
        self._routes_failing = False

    def begin_shutdown(self) -> None:
        """Called by the server when it starts shutting down (before it waits for open responses)."""
        self.state.stopping.set()

    @asynccontextmanager
    async def _lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        self.state.auth.warn_if_open()
        self.state.stopping.clear()
        self.state.writer.start()
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(
                self.state.settings.db_threads, thread_name_prefix="trajgate-db", initializer=name_os_thread
            )
        )
        await self.state.proxy.start()
        await self._refresh_routes()
        refresher = asyncio.create_task(self._refresh_routes_forever())
        prober = self._probe_replicas()
        peers = self.state.peers
        heartbeat = None
        if peers.enabled:
            await peers.beat()  # other gateways wait for this one before it answers its first call
            heartbeat = asyncio.create_task(peers.beat_forever())
        log.info("gateway ready: upstream %s", self.state.settings.upstream_url)
        try:
            yield
        finally:
            self.state.stopping.set()
            refresher.cancel()
            if prober is not None:
                prober.cancel()
            if heartbeat is not None:
                heartbeat.cancel()
            await self.state.proxy.close()
            self.state.writer.close()
            peers.leave()
            self.state.engine.dispose()

    async def _refresh_routes(self) -> None:
        """Reload the routing table off the event loop; while the database is away, keep routing by the last one."""
        try:
            await asyncio.to_thread(self.state.router.refresh, self.state.engine)
        except SQLAlchemyError as exc:
            if not self._routes_failing:
                log.warning("cannot refresh run routes (policy versions, sampling overrides): %s", type(exc).__name__)
            self._routes_failing = True
        else:
            if self._routes_failing:
                log.info("run routes refreshed again")
            self._routes_failing = False

    def _probe_replicas(self) -> asyncio.Task[None] | None:
        """With several vLLM replicas, ask each one's /models in the background (health, adapters it serves)."""
        proxy = self.state.proxy
        if not proxy.replicas.several:
            return None
        assert proxy.session is not None
        every_s = self.state.settings.replica_probe_s
        return asyncio.create_task(proxy.replicas.probe_forever(proxy.session, proxy.upstream_headers, every_s))

    async def _refresh_routes_forever(self) -> None:
        while True:
            await asyncio.sleep(ROUTE_REFRESH_S)
            await self._refresh_routes()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            prefix = split_path(scope["path"])
            path = prefix.rest if prefix else scope["path"]
            if path in ENDPOINTS:
                if scope["method"] == "POST":
                    await self.state.proxy.handle(scope, receive, send, prefix)
                else:
                    error = GatewayError(405, f"{scope['method']} is not allowed here; use POST", code="method_not_allowed")
                    await send_json(send, 405, error.body(), [(b"allow", b"POST")])
                return
            if path == api_responses.PATH and scope["method"] == "POST":
                await self.state.responses.create(scope, receive, send, prefix)
                return
            if path in api_messages.PATHS or path.startswith(api_messages.PATH_PREFIX):
                await self.state.messages.handle(scope, receive, send, prefix)
                return
            if prefix is not None:
                scope = {**scope, "path": path, "raw_path": path.encode()}
            if b"%00" in scope["query_string"]:
                # No parameter of these endpoints may hold a NUL (Postgres refuses one in a query): said once here.
                error = GatewayError(400, "a query parameter holds a NUL character (%00)", code="invalid_value")
                await send_json(send, 400, error.body(), [])
                return
        await self.api(scope, receive, send)


def create_app(settings: Settings) -> Gateway:
    return Gateway(settings)
