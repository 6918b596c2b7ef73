"""A vLLM-shaped upstream for fast tests: it replays responses recorded from the real vLLM CPU server.

A request is answered only if its body equals a recorded request exactly (after the gateway's rewriting and
injection), so replay also proves the gateway forwards bodies unchanged, with one exception: the sampling parameters
the gateway sets in train mode (gateway.sampling.NEUTRAL) are left out of the match. The recordings are greedy so a
re-record gives the same tokens, while train mode samples at temperature 1; tests assert those parameters on
`received`. Fault modes (`mode`) cover what real
vLLM can't be made to do on demand: a 500, a hang, a stream cut mid-way.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

from aiohttp import web

from gateway.sampling import NEUTRAL

FIXTURES = Path(__file__).parent / "fixtures" / "vllm"


def load_fixtures(directory: Path = FIXTURES) -> dict[str, dict[str, Any]]:
    return {path.stem: json.loads(path.read_text()) for path in sorted(directory.glob("*.json"))}


_TRUE = (True, 1, "1", "on", "t", "true", "y", "yes")


def _without_sampling(body: Any) -> Any:
    """The body as matched: sampling parameters left out, and `stream` read the way vLLM's pydantic model reads it
    ("true", 1 and "yes" stream)."""
    if not isinstance(body, dict):
        return body
    out = {k: v for k, v in body.items() if k not in NEUTRAL}
    if "stream" in out:
        flag = out["stream"]
        out["stream"] = (flag.lower() if isinstance(flag, str) else flag) in _TRUE
    return out


class FakeUpstream:
    """Runs an aiohttp server on its own thread and loop; tests read `received` and set `mode`."""

    def __init__(self, fixtures: dict[str, dict[str, Any]] | None = None, chunk_delay_s: float = 0.0) -> None:
        self.fixtures = fixtures if fixtures is not None else load_fixtures()
        self.chunk_delay_s = chunk_delay_s
        self.mode = "replay"  # replay | error500 | fail_once (one 500, then replay) | hang | cut_stream | slow_stream
        self.received: list[dict[str, Any]] = []
        self.cancelled_streams = 0
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def fixture(self, name: str) -> dict[str, Any]:
        return self.fixtures[name]

    def _match(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        for fixture in self.fixtures.values():
            if fixture.get("path") == path and _without_sampling(fixture.get("request")) == _without_sampling(body):
                return fixture
        return None

    async def _models(self, _: web.Request) -> web.Response:
        fixture = self.fixtures.get("models")
        if fixture is None:
            return web.json_response({"object": "list", "data": [{"id": "smollm2", "object": "model"}]})
        return web.json_response(fixture["response"])

    async def _post(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            return web.json_response({"error": {"message": "bad json", "type": "BadRequestError", "code": 400}}, status=400)
        self.received.append(body)
        if self.mode in ("error500", "fail_once"):
            if self.mode == "fail_once":
                self.mode = "replay"
            return web.json_response(
                {"error": {"message": "EngineCore died", "type": "InternalServerError", "param": None, "code": 500}},
                status=500,
            )
        if self.mode == "hang":
            await asyncio.sleep(3600)
        fixture = self._match(request.path, body)
        if fixture is None:
            message = f"fake upstream: no recorded response for {request.path} with body {json.dumps(body)[:400]}"
            return web.json_response({"error": {"message": message, "type": "NoFixture", "code": 418}}, status=418)
        if not fixture.get("stream") or fixture.get("status") != 200:
            content_type = fixture.get("headers", {}).get("content-type", "application/json")
            response = fixture["response"]
            text = response if isinstance(response, str) else json.dumps(response)
            return web.Response(status=fixture["status"], body=text.encode(), headers={"content-type": content_type})
        return await self._stream(request, fixture["chunks"])

    async def _stream(self, request: web.Request, chunks: list[str]) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers={"content-type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        try:
            for position, payload in enumerate(chunks):
                if self.mode == "cut_stream" and position == len(chunks) // 2:
                    request.transport.close()  # type: ignore[union-attr]
                    return response
                await response.write(f"data: {payload}\n\n".encode())
                delay = 0.2 if self.mode == "slow_stream" else self.chunk_delay_s
                if delay:
                    await asyncio.sleep(delay)
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            self.cancelled_streams += 1
            raise
        return response

    def start(self) -> FakeUpstream:
        ready = threading.Event()

        async def boot() -> None:
            app = web.Application(client_max_size=64 * 1024 * 1024)
            app.router.add_get("/v1/models", self._models)
            app.router.add_post("/v1/{tail:.*}", self._post)
            self._runner = web.AppRunner(app, handle_signals=False)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            ready.set()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(boot())
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="fake-upstream", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fake upstream did not start")
        return self

    def stop(self) -> None:
        if self._loop is None:
            return
        loop = self._loop

        async def shutdown() -> None:
            if self._runner is not None:
                await self._runner.cleanup()
            loop.stop()

        asyncio.run_coroutine_threadsafe(shutdown(), loop)
        if self._thread is not None:
            self._thread.join(10)
