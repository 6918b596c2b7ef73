"""OpenAI-style error bodies: every error the gateway itself produces looks like one the SDKs already parse."""

from __future__ import annotations

import orjson


class GatewayError(Exception):
    """An error to send to the client as `{"error": {...}}` with an HTTP status; never a stack trace."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | int | None = None,
        param: str | None = None,
        retry_after_s: int | None = None,
    ):
        # code and param are vLLM's own (an int code, the offending field) when its client error is passed through
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s  # sent as Retry-After: the request may succeed when retried after it

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"retry-after": str(self.retry_after_s)}

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(
    message: str, type_: str = "invalid_request_error", code: str | int | None = None, param: str | None = None
) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})


class UpstreamFailure(Exception):
    """A step of a call to vLLM answered with an error; carries what the client is told."""

    def __init__(self, error: GatewayError) -> None:
        super().__init__(error.message)
        self.error = error
