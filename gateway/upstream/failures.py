"""What a client is told when vLLM fails a call: every surface (chat, token_in, and through them Messages and
Responses) turns a timeout, a broken connection or an error answer into the same GatewayError, which each edge
translator then writes once in its own API's error shape."""

from __future__ import annotations

import contextlib
from typing import Any

import orjson

from gateway.http.errors import GatewayError
from gateway.upstream.client import UpstreamError

SCALE_OUT_HINT = "start vLLM with --enable-scale-out to use token_mode token_in"


def exchange_error(exc: TimeoutError | UpstreamError, path: str | None = None) -> GatewayError:
    """vLLM did not answer, or broke off its answer: a timeout is a 504, anything else a 502. `path` names the step
    where a call takes several (token_in's scale-out endpoints); a chat call has one and leaves it out."""
    where = f" on {path}" if path else ""
    if isinstance(exc, TimeoutError):
        return GatewayError(504, f"vLLM timed out{where}", "upstream_error", "timeout")
    message = f"vLLM unreachable{where}: {type(exc).__name__}: {exc}"
    return GatewayError(502, message, "upstream_error", "upstream_error")


def upstream_error(path: str, status: int, raw: bytes) -> GatewayError:
    """vLLM answered `status` (not 200) with `raw` on a step whose answer the gateway reads (token_in's scale-out
    endpoints; the chat path hands vLLM's own answer on instead). A 403 means the endpoints are off (one clear error
    naming the flag); other client errors pass vLLM's status and error (message, type, param, code) through as chat
    mode does; server errors become a 502."""
    if status == 403:
        return GatewayError(502, f"vLLM refused {path} (403): {SCALE_OUT_HINT}", "upstream_error", "scale_out_disabled")
    message = body_message(raw)
    error_type = "upstream_error"
    code: str | int | None = None
    param: str | None = None
    with contextlib.suppress(orjson.JSONDecodeError, AttributeError, TypeError):
        error = orjson.loads(raw).get("error")
        if isinstance(error, dict):
            error_type = str(error.get("type") or error_type)
            code = error.get("code") if isinstance(error.get("code"), (str, int)) else None
            param = error.get("param") if isinstance(error.get("param"), str) else None
    if 400 <= status < 500:
        return GatewayError(status, message, error_type, code, param)
    return GatewayError(502, f"vLLM answered {status} on {path}: {message}", "upstream_error", "upstream_error")


def body_message(raw: bytes) -> str:
    """The message of an error body vLLM (or the gateway's chat path) answered, the one way every API reads it:
    OpenAI's `error.message` (or an `error` string), else a top-level `message` or FastAPI's `detail`, else the text
    itself (the first 4,000 bytes, NULs replaced so that Postgres can store it)."""
    text = raw[:4000].decode("utf-8", "replace").replace("\x00", "\ufffd")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return text or "upstream error"
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str) and error:
            return error
        for key in ("message", "detail"):
            if data.get(key):
                return str(data[key]) if isinstance(data[key], str) else orjson.dumps(data[key]).decode()
    return text


def not_json(path: str) -> GatewayError:
    """vLLM answered 200 on a step whose answer the gateway reads, with something other than a JSON object."""
    return GatewayError(502, f"vLLM sent a body that is not a JSON object on {path}", "upstream_error")


def stream_error(error: Any) -> GatewayError:
    """vLLM's generate stream, begun with a 200, sent an `error` object where a chunk was due (the chat path relays
    such an event as it is; token_in reads generate's stream and must tell the client itself)."""
    message = (error or {}).get("message") if isinstance(error, dict) else error
    return GatewayError(502, f"vLLM generate stream failed: {message}", "upstream_error")
