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

from gateway.errors import GatewayError
from gateway.store.records import ping

if TYPE_CHECKING:
    from gateway.app import GatewayState

log = logging.getLogger("trajgate.api")
router = APIRouter()


def state(request: Request) -> GatewayState:
    return request.app.state.gateway


@router.get("/health")
async def health() -> dict[str, str]:
    """The process is up (liveness)."""
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """The database and vLLM are reachable (readiness): 503 names what isn't."""
    gw = state(request)
    db_ok = await asyncio.to_thread(ping, gw.engine)
    try:
        await gw.proxy.upstream_models()
        upstream_ok = True
    except GatewayError:
        upstream_ok = False
    body = {"database": "ok" if db_ok else "unreachable", "upstream": "ok" if upstream_ok else "unreachable"}
    return JSONResponse(body, status_code=200 if db_ok and upstream_ok else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(state(request).metrics.render(), media_type="text/plain; version=0.0.4")


@router.get("/v1/models")
async def models(request: Request) -> dict[str, object]:
    """The runs, named as agents should call them, plus the base model."""
    gw = state(request)
    base = await gw.proxy.base_model()
    now = int(time.time())
    names = [base] + [run for run in gw.router.runs() if run != base]
    return {
        "object": "list",
        "data": [{"id": name, "object": "model", "created": now, "owned_by": "trajgate"} for name in names],
    }


def install_error_handlers(app: FastAPI) -> None:
    """Every error the gateway produces is OpenAI-shaped JSON, never HTML or a stack trace."""

    @app.exception_handler(GatewayError)
    async def _gateway_error(_: Request, exc: GatewayError) -> Response:
        return Response(exc.body(), status_code=exc.status, media_type="application/json")

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
