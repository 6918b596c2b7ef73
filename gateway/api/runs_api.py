"""Runs (admin key): their configuration, their progress, their training steps live, and their export.

Run names may contain '/' (hub-style model names), so the routes that extend a run's path are declared before
the bare `/v1/runs/{run}` that would otherwise swallow them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from sqlalchemy.exc import InterfaceError, OperationalError, SQLAlchemyError

from gateway.http import sse
from gateway.http.deps import gateway_state, json_response, read_json, require_admin, validated, validation_message
from gateway.http.errors import GatewayError
from gateway.judge.policy import JudgeNotAllowed, JudgePolicy
from gateway.runs.names import run_name_problem
from gateway.store.export import iter_trajectories
from gateway.store.runs import MissingBaseModel, list_runs, run_exists, run_view, steps_after, upsert_run

if TYPE_CHECKING:
    from gateway.http.deps import GatewayState

log = logging.getLogger("trajgate.runs")
router = APIRouter(dependencies=[Depends(require_admin)])

POLL_S = 0.5  # how often the event stream looks for new steps
KEEPALIVE_S = 15.0  # idle proxies and load balancers close silent connections


class RunBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    base_model: str | None = Field(None, min_length=1, max_length=512)
    base_weights: str | None = Field(None, min_length=1, max_length=1024)
    config: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _run_name(cls, name: str) -> str:
        problem = run_name_problem(name)
        if problem is not None:
            raise ValueError(f"{problem} (agents send it as `model`)")
        return name


@router.post("/v1/runs")
async def post_run(request: Request) -> Response:
    """Create a run or update its config: `config` is merged key by key over what is stored (or the defaults).
    201 when created, 200 when updated; sampling overrides apply to the run's next call."""
    body = validated(RunBody, await read_json(request))
    gw = gateway_state(request)
    judge = body.config.get("judge")
    if isinstance(judge, dict):  # (anything else is refused by the config's own validation)
        policy = JudgePolicy.from_settings(gw.settings)
        try:
            policy.check(judge.get("api_key_env"), judge.get("api_base"), "config.judge")
        except JudgeNotAllowed as exc:
            raise GatewayError(400, str(exc), code="judge_not_allowed") from None
    default_base_model = gw.router.base_model
    if body.base_model is None and default_base_model is None:
        try:
            default_base_model = await gw.proxy.base_model()
        except GatewayError:
            pass  # only needed if the run is new; the store says so then
    try:
        created = await asyncio.to_thread(
            upsert_run, gw.engine, body.name, body.config, body.base_model, body.base_weights, default_base_model
        )
    except ValidationError as exc:
        raise GatewayError(422, validation_message(exc, "config"), code="invalid_value") from None
    except MissingBaseModel as exc:
        raise GatewayError(422, str(exc), code="invalid_value") from None
    await asyncio.to_thread(gw.router.refresh, gw.engine)
    view = await asyncio.to_thread(run_view, gw.engine, body.name)
    return json_response(view, 201 if created else 200)


@router.get("/v1/runs")
async def get_runs(request: Request) -> Response:
    runs = await asyncio.to_thread(list_runs, gateway_state(request).engine)
    return json_response({"object": "list", "data": runs})


def _check_run_name(run: str) -> None:
    """A name no run can have is the client's mistake, said as such (and never sent to the database, which
    refuses a NUL in a query with an error of its own)."""
    problem = run_name_problem(run)
    if problem is not None:
        raise GatewayError(400, f"run name {run[:160]!r} is not valid: {problem}", code="invalid_run_name")


async def _require_run(gw: GatewayState, run: str) -> None:
    _check_run_name(run)
    if not await asyncio.to_thread(run_exists, gw.engine, run):
        raise GatewayError(404, f"no run {run!r}", code="run_not_found")


MAX_STEP = 2**31 - 1  # steps are int4 in the store


def _after(value: str | None) -> int:
    """`after` as a step number, or a 400: a value the store cannot compare with (1e30) is the client's error."""
    if value is None:
        return -1
    text = value.strip()
    digits = text[1:] if text.startswith("-") else text
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 10 or not -1 <= int(text) <= MAX_STEP:
        raise GatewayError(400, f"after: expected an integer step from -1 to {MAX_STEP}", code="invalid_value")
    return int(text)


@router.get("/v1/runs/{run:path}/steps")
async def get_steps(
    run: str, request: Request, after: str | None = None, limit: int = Query(1000, ge=1, le=10_000)
) -> Response:
    """Training steps with step > `after`, oldest first, at most `limit`."""
    gw = gateway_state(request)
    after_step = _after(after)
    await _require_run(gw, run)
    steps = await asyncio.to_thread(steps_after, gw.engine, run, after_step, limit)
    return json_response({"object": "list", "data": steps})


@router.get("/v1/runs/{run:path}/events")
async def get_events(
    run: str, request: Request, after: str | None = None, stream_format: str | None = Query(None, alias="format")
) -> StreamingResponse:
    """A line per training step as the trainer records it: every step after `after` (default: the whole history),
    then new ones live. Server-sent events by default (`id:` is the step, so a reconnecting EventSource resumes
    via Last-Event-ID); NDJSON with `Accept: application/x-ndjson` or `?format=ndjson`."""
    if stream_format not in (None, "ndjson", "sse"):
        raise GatewayError(422, "format: expected 'sse' or 'ndjson'", code="invalid_value")
    gw = gateway_state(request)
    after_step = _after(after)
    await _require_run(gw, run)
    try:
        after_step = max(after_step, _after(request.headers.get("last-event-id")))
    except GatewayError:
        pass  # not an id this stream sent: resume from `after`
    ndjson = stream_format == "ndjson" or (
        stream_format is None and "application/x-ndjson" in request.headers.get("accept", "")
    )
    return StreamingResponse(
        _follow(gw, run, after_step, ndjson),
        media_type="application/x-ndjson" if ndjson else "text/event-stream",
        headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
    )


async def _follow(gw: GatewayState, run: str, after: int, ndjson: bool) -> AsyncIterator[bytes]:
    """Poll for new steps until the client leaves (Starlette then cancels this) or the gateway shuts down."""
    keepalive = b"\n" if ndjson else sse.KEEPALIVE
    last_write = time.monotonic()
    while not gw.stopping.is_set():
        try:
            steps = await asyncio.to_thread(steps_after, gw.engine, run, after)
        except (OperationalError, InterfaceError) as exc:  # the database is away: keep the stream, try next poll
            log.warning("event stream for run %r: database unavailable: %s", run, type(exc).__name__)
            steps = []
        except SQLAlchemyError as exc:  # anything else will fail the same way on every poll: end the stream
            log.error("event stream for run %r ended: %s", run, type(exc).__name__)
            return
        for step in steps:
            data = orjson.dumps(step)
            yield data + b"\n" if ndjson else sse.frame(data, id=step["step"])
            after = step["step"]
            last_write = time.monotonic()
        if time.monotonic() - last_write >= KEEPALIVE_S:
            yield keepalive
            last_write = time.monotonic()
        await asyncio.sleep(POLL_S)


@router.get("/v1/runs/{run:path}/export")
async def export(run: str, request: Request, include_eval: bool = False) -> StreamingResponse:
    """The run's trajectories as NDJSON, streamed; the same records as `trajgate export --format jsonl`."""
    gw = gateway_state(request)
    await _require_run(gw, run)

    def lines() -> Iterator[bytes]:
        for trajectory in iter_trajectories(gw.engine, run, include_eval=include_eval):
            yield orjson.dumps(trajectory, option=orjson.OPT_APPEND_NEWLINE)

    return StreamingResponse(lines(), media_type="application/x-ndjson")


@router.get("/v1/runs/{run:path}")
async def get_run(run: str, request: Request) -> Response:
    """Config, current policy version, groups by state, trajectory counts, the last step, the eval curve."""
    _check_run_name(run)
    view = await asyncio.to_thread(run_view, gateway_state(request).engine, run)
    if view is None:
        raise GatewayError(404, f"no run {run!r}", code="run_not_found")
    return json_response(view)
