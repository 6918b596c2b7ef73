"""Small ASGI helpers the streaming paths share (chat relay and token_in)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from starlette.types import Receive, Send

from gateway.http import sse
from gateway.http.errors import UpstreamFailure
from gateway.upstream.client import UpstreamError

log = logging.getLogger("trajgate.proxy")


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns once the client hangs up; run beside a stream to stop generating for a client that left."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def relay_until_done(
    relay: Awaitable[None], receive: Receive, send: Send, done: Callable[[], bool], record: Callable[[str], None]
) -> str | None:
    """Run a stream relay until it ends or the client hangs up; returns why the stream ended early (for the call's
    record), None when it did not. Cancelling the relay on a hang-up stops reading from vLLM, which lets it abort
    the generation; every failure other than a client that left is told in-band, so a stream is never cut silently,
    and `record(error)` runs before the client is told, so the failed call is in the write-ahead log first.

    The relay runs in the calling task and only the watch for a hang-up gets a task of its own: a second task and
    `asyncio.wait` around them cost more per stream than relaying a short answer's events.
    """
    task = asyncio.current_task()
    assert task is not None
    left = False

    async def watch() -> None:
        nonlocal left
        try:
            await wait_for_disconnect(receive)
        except Exception:  # a receive that fails is a client we can no longer hear: the same as one that left
            pass
        left = True
        task.cancel()  # never after the relay: `hangup` is cancelled before the caller next awaits

    hangup = asyncio.ensure_future(watch())
    error: str | None = None
    told: str | None = None
    try:
        await relay
    except asyncio.CancelledError:
        if not left or task.uncancel() > 0:
            raise  # cancelled from outside: the server is shutting down
        if not done():
            error = "client disconnected mid-stream"
    except UpstreamFailure as failure:
        error = told = failure.error.message
    except (UpstreamError, TimeoutError) as exc:
        error, told = f"vLLM stream broke: {type(exc).__name__}: {exc}", "vLLM stream ended unexpectedly"
    except OSError:  # a write to a client that already left
        if not done():
            error = "client disconnected mid-stream"
    except Exception as exc:
        log.exception("stream relay failed")
        error = f"stream relay failed: {type(exc).__name__}: {exc}"
        told = "the gateway could not relay vLLM's stream"
    finally:
        hangup.cancel()
    if told is not None:
        assert error is not None
        record(error)
        with contextlib.suppress(OSError):
            await send({"type": "http.response.body", "body": sse.error_event(told), "more_body": True})
    return error
