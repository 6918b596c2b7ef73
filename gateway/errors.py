"""OpenAI-style error bodies: every error the gateway itself produces looks like one the SDKs already parse."""

from __future__ import annotations

import orjson


class GatewayError(Exception):
    """An error to send to the client as `{"error": {...}}` with an HTTP status; never a stack trace."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code)


def error_body(message: str, type_: str = "invalid_request_error", code: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}})


class UpstreamFailure(Exception):
    """A step of a call to vLLM answered with an error; carries what the client is told."""

    def __init__(self, error: GatewayError) -> None:
        super().__init__(error.message)
        self.error = error
