"""The gateway's ordinary endpoints (everything but the proxied model calls): thin handlers over the store."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.http.auth import presented_key
from gateway.http.deps import GatewayState, agent_runs, gateway_state
from gateway.http.errors import GatewayError
from gateway.store.records import ping

if TYPE_CHECKING:
    from gateway.upstream.replicas import Replica

log = logging.getLogger("trajgate.api")
router = APIRouter()


@router.get("/health")
async def health() -> dict[str, str]:
    """The process is up (liveness)."""
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """The database and vLLM are reachable (readiness): 503 names what isn't. With several replicas, each is listed
    and one reachable replica is enough to be ready."""
    gw = gateway_state(request)
    db_ok = await asyncio.to_thread(ping, gw.engine)
    replicas = gw.proxy.replicas.all
    reachable = await asyncio.gather(*(_answers(gw, replica) for replica in replicas))
    upstream_ok = any(reachable)
    body: dict[str, object] = {
        "database": "ok" if db_ok else "unreachable",
        "upstream": "ok" if upstream_ok else "unreachable",
    }
    if gw.proxy.replicas.several:
        body["replicas"] = {r.url: "ok" if ok else "unreachable" for r, ok in zip(replicas, reachable, strict=True)}
    return JSONResponse(body, status_code=200 if db_ok and upstream_ok else 503)


async def _answers(gw: GatewayState, replica: Replica) -> bool:
    try:
        await gw.proxy.upstream_models(replica)
    except GatewayError:
        return False
    return True


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    # The process's own figures are open, as scrapers expect; the per-run series name every run, so with an admin
    # key set only a scrape that sends it gets them (a tenant must not learn other tenants' runs from this page).
    # In a worker thread: the per-run gauges read the database (at most once a second), never on the event loop.
    gw = gateway_state(request)
    with_runs = gw.auth.is_admin(presented_key(dict(request.headers)))
    body = await asyncio.to_thread(gw.metrics.render, with_runs)
    return Response(body, media_type="text/plain; version=0.0.4")


@router.get("/v1/models")
async def models(request: Request) -> dict[str, object]:
    """The runs, named as agents should call them, plus the base model. Once some key is bound to runs (tenants),
    which runs exist is not for everyone to read: an agent key is needed, and a bound key is shown only its runs."""
    gw = gateway_state(request)
    runs = agent_runs(request) if gw.auth.bound else None
    base = await gw.proxy.base_model()
    now = int(time.time())
    names = [base] + [run for run in gw.router.runs() if run != base]
    if runs is not None:
        names = sorted(runs)
    data: list[dict[str, object]] = [
        {"id": name, "object": "model", "created": now, "owned_by": "trajgate"} for name in names
    ]
    replicas = gw.proxy.replicas
    if replicas.several:
        # Which replicas serve each name now (the run's current adapter), as their last /models probe said.
        for entry in data:
            served = gw.router.resolve(str(entry["id"]), base).served_name
            entry["replicas"] = [r.url for r in replicas.all if r.healthy and r.served and served in r.served]
    return {"object": "list", "data": data}


def install_error_handlers(app: FastAPI) -> None:
    """Every error the gateway produces is OpenAI-shaped JSON, never HTML or a stack trace."""

    @app.exception_handler(GatewayError)
    async def _gateway_error(_: Request, exc: GatewayError) -> Response:
        return Response(exc.body(), status_code=exc.status, media_type="application/json", headers=exc.headers())

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        error = GatewayError(exc.status_code, str(exc.detail), "invalid_request_error")
        return Response(error.body(), status_code=exc.status_code, media_type="application/json")

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(part) for part in first["loc"])
        error = GatewayError(422, f"{where}: {first['msg']}", "invalid_request_error", "invalid_value")
        return Response(error.body(), status_code=422, media_type="application/json")

    @app.exception_handler(OperationalError)
    async def _database_unavailable(_: Request, exc: OperationalError) -> Response:
        # Rewards and reads need the database (model calls don't: they spool). Say so; retrying later works.
        log.warning("database unavailable: %s", type(exc.orig).__name__ if exc.orig else type(exc).__name__)
        error = GatewayError(503, "database unavailable; retry later", "server_error", "database_unavailable")
        return Response(error.body(), status_code=503, media_type="application/json")

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        # Logged with its traceback by the server; the client gets an OpenAI-style body, never the trace.
        error = GatewayError(500, f"internal error ({type(exc).__name__})", "server_error", "internal_error")
        return Response(error.body(), status_code=500, media_type="application/json")
