"""What every endpoint depends on: the gateway's state object, key checks as dependencies, and request bodies read
with a size limit and validated into OpenAI-style errors.

The state lives here, not in the composition root (gateway/app.py), so the routers (gateway/api, gateway/edge,
gateway/ui) import no entry point and the import graph has no cycle (tests/test_layers.py).

Bodies are parsed with the standard library's JSON parser on purpose: Python clients serialise a NaN reward as the
non-standard literal `NaN`, and that must come back as a 422 saying the reward is not finite, not as unparseable
JSON. What the store's JSON encoder could not write (integers beyond 64 bits, a lone surrogate, nesting deeper than
254 levels) is refused here, so no such body gets as far as a 500.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

import orjson
from fastapi import Request, Response
from pydantic import AfterValidator, BaseModel, Field, ValidationError
from sqlalchemy import Engine

from gateway.http.auth import Auth, presented_key
from gateway.http.errors import GatewayError
from gateway.http.metrics import GatewayMetrics
from gateway.proxy.attribution import split_api_key
from gateway.proxy.hot_path import Proxy
from gateway.proxy.routing import PolicyRouter
from gateway.recorder.heartbeat import Peers
from gateway.recorder.writer import RecordWriter
from gateway.runs.settings import Settings

Model = TypeVar("Model", bound=BaseModel)


@dataclass
class GatewayState:
    """Everything one gateway process serves with, built by gateway.app.build_state."""

    settings: Settings
    engine: Engine
    writer: RecordWriter
    router: PolicyRouter
    auth: Auth
    metrics: GatewayMetrics
    proxy: Proxy
    # The edge translators (gateway.edge: ResponsesAPI, MessagesApi) and the trajectory page's token strings per call
    # id (gateway.ui.token_text.TokenTextCache). Typed loosely on purpose: those modules import this one, so naming
    # their classes here would be an import cycle; the composition root that builds them knows their types.
    responses: Any
    messages: Any
    token_texts: Any
    peers: Peers
    # Set when the server begins a graceful shutdown, so endless responses (the event stream) end and let it finish.
    stopping: threading.Event = field(default_factory=threading.Event)


def gateway_state(request: Request) -> GatewayState:
    return request.app.state.gateway


async def require_agent(request: Request) -> None:
    """An agent key or the admin key; an agent's `key#group/trajectory` form is accepted here too, so one
    configured client can both call the model and post rewards."""
    agent_runs(request)


def agent_runs(request: Request) -> frozenset[str] | None:
    """The runs the caller's agent key is bound to (None: any run), after the same check as `require_agent`
    (401 for a bad key): what a handler needs whose run is known only once it has looked something up."""
    key, _, _ = split_api_key(presented_key(dict(request.headers)))
    return gateway_state(request).auth.check_agent(key)


async def require_admin(request: Request) -> None:
    gateway_state(request).auth.check_admin(presented_key(dict(request.headers)))


async def read_json(request: Request, nul_ok: bool = False) -> Any:
    """The body as JSON (None if empty), refusing anything over the gateway's body limit, and any string holding a NUL
    character unless `nul_ok`: Postgres text cannot hold one, so a name or a setting with one would be a 500 (JSON
    columns store it as U+FFFD, which is what a reward's metadata may have)."""
    limit = gateway_state(request).settings.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    if not body.strip():
        return None
    try:
        data = json.loads(body, parse_int=_int64)
    except _OutOfRange as exc:
        raise GatewayError(422, str(exc), code="invalid_value") from None
    except (ValueError, RecursionError) as exc:
        raise GatewayError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    try:
        orjson.dumps(data)  # what every JSON column is written with
    except orjson.JSONEncodeError as exc:
        raise GatewayError(400, f"request body cannot be stored: {exc}", code="invalid_json") from None
    if not nul_ok and b"\\u0000" in body and _holds_nul(data):  # (JSON spells a NUL only as that escape)
        raise GatewayError(400, "request body: a string holds a NUL character (\\u0000)", code="invalid_value")
    return data


def _holds_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_holds_nul(k) or _holds_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_holds_nul(item) for item in value)
    return False


class _OutOfRange(Exception):
    pass


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _int64(text: str) -> int:
    # The length check first: int() refuses more than 4,300 digits with a ValueError of its own.
    if len(text) > 20 or not INT64_MIN <= int(text) <= INT64_MAX:
        raise _OutOfRange(f"integer {text[:40]} is out of range (at most 64 bits)")
    return int(text)


def json_response(body: Any, status: int = 200) -> Response:
    """JSON via orjson, which writes a -inf logprob (a token vLLM forced) as null where the standard encoder would
    fail the whole response."""
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def _too_large(limit: int) -> GatewayError:
    return GatewayError(413, f"request body larger than {limit} bytes", code="request_too_large")


def validation_message(exc: ValidationError, prefix: str = "") -> str:
    """`where: what` for the first problem, e.g. `reward: Input should be a finite number`."""
    first = exc.errors()[0]
    where = ".".join(str(part) for part in (prefix, *first["loc"]) if part != "") or "body"
    return f"{where}: {first['msg']}"


def validated(model: type[Model], data: Any, prefix: str = "") -> Model:
    """`data` as `model`, or a 422 naming the first bad field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise GatewayError(422, validation_message(exc, prefix), code="invalid_value") from None


def _no_nan(value: Any) -> Any:
    """JSON fields are stored as JSON, which has no NaN or infinity (Postgres refuses them)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("must not contain NaN or infinity")
    if isinstance(value, dict):
        for item in value.values():
            _no_nan(item)
    elif isinstance(value, list):
        for item in value:
            _no_nan(item)
    return value


# A JSON number that is a real, finite number: no NaN/Infinity, and no "1.5" strings or booleans coerced.
FiniteNumber = Annotated[float, Field(strict=True, allow_inf_nan=False)]
JsonObject = Annotated[dict[str, Any], AfterValidator(_no_nan)]
