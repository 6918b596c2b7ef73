"""relay_until_done: the relay runs in the caller's task, and only a client's hang-up (not a shutdown) is swallowed."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.proxy.asgi_io import ChatAnswer, relay_until_done


class Client:
    """An ASGI receive/send pair: `leave()` makes receive answer http.disconnect; sends are kept."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()
        self.sent: list[dict[str, Any]] = []

    def leave(self) -> None:
        self.gone.set()

    def leave_soon(self) -> asyncio.Future[None]:
        """Hang up a moment from now, while the relay is under way."""

        async def later() -> None:
            await asyncio.sleep(0.01)
            self.leave()

        return asyncio.ensure_future(later())

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    def tell(self, message: str) -> Any:
        """An in-band failure, told as the chat client is told one."""
        return ChatAnswer(self.send).broke(message)


async def test_finished_relay_returns_no_error_and_stops_watching() -> None:
    client = Client()
    recorded: list[str] = []

    async def relay() -> None:
        await asyncio.sleep(0)

    error = await relay_until_done(relay(), client.receive, client.tell, lambda: True, recorded.append)
    client.leave()  # after the end: must not cancel the caller, which goes on to finish the response
    await asyncio.sleep(0.01)
    assert error is None and recorded == [] and client.sent == []


async def test_hangup_cancels_the_relay_and_the_caller_goes_on() -> None:
    client = Client()
    cancelled = asyncio.Event()

    async def relay() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    leaving = client.leave_soon()
    error = await relay_until_done(relay(), client.receive, client.tell, lambda: False, lambda _: None)
    await leaving
    assert cancelled.is_set()
    assert error == "client disconnected mid-stream"
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0  # the hang-up's cancel was taken back
    await asyncio.sleep(0)  # and the caller can still await


async def test_hangup_after_done_is_no_error() -> None:
    client = Client()

    async def relay() -> None:
        await asyncio.sleep(30)

    leaving = client.leave_soon()
    error = await relay_until_done(relay(), client.receive, client.tell, lambda: True, lambda _: None)
    await leaving
    assert error is None


async def test_a_shutdown_still_cancels_the_caller() -> None:
    client = Client()
    started = asyncio.Event()

    async def relay() -> None:
        started.set()
        await asyncio.sleep(30)

    async def handler() -> str | None:
        return await relay_until_done(relay(), client.receive, client.tell, lambda: False, lambda _: None)

    task = asyncio.ensure_future(handler())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_failing_receive_counts_as_a_hangup() -> None:
    async def broken_receive() -> dict[str, Any]:
        raise RuntimeError("connection state lost")

    async def send(message: dict[str, Any]) -> None:
        pass

    async def relay() -> None:
        await asyncio.sleep(30)

    tell = ChatAnswer(send).broke
    error = await asyncio.wait_for(relay_until_done(relay(), broken_receive, tell, lambda: False, lambda _: None), 5)
    assert error == "client disconnected mid-stream"


async def test_a_failed_relay_is_recorded_then_told_in_band() -> None:
    client = Client()
    order: list[str] = []

    async def relay() -> None:
        raise ValueError("bad event")

    async def send(message: dict[str, Any]) -> None:
        order.append("told")
        client.sent.append(message)

    tell = ChatAnswer(send).broke
    error = await relay_until_done(relay(), client.receive, tell, lambda: False, lambda e: order.append("recorded"))
    assert error == "stream relay failed: ValueError: bad event"
    assert order == ["recorded", "told"]
    assert b"could not relay" in client.sent[0]["body"]
