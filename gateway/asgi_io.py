"""Small ASGI helpers the streaming paths share (chat relay and token_in)."""

from __future__ import annotations

from typing import Any

import orjson


async def wait_for_disconnect(receive: Any) -> None:
    """Returns once the client hangs up; run beside a stream to stop generating for a client that left."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def send_sse_error(send: Any, message: str) -> None:
    """Tell a client in-band that its stream failed: the status line has already been sent."""
    event = orjson.dumps({"error": {"message": message, "type": "upstream_error", "param": None, "code": None}})
    await send({"type": "http.response.body", "body": b"data: " + event + b"\n\n", "more_body": True})
