"""A vLLM-shaped upstream for fast tests: it replays responses recorded from the real vLLM CPU server.

A request is answered only if its body equals a recorded request exactly (after the gateway's rewriting and
injection), so replay also proves the gateway forwards bodies unchanged, with one exception: the sampling parameters
the gateway sets in train mode (gateway.proxy.sampling.NEUTRAL) are left out of the match. The recordings are greedy so a
re-record gives the same tokens, while train mode samples at temperature 1; tests assert those parameters on
`received`. Fault modes (`mode`) cover what real
vLLM can't be made to do on demand: a 500, a hang, a stream cut mid-way.

A fixture may hold several `exchanges` (token_in's render/generate/derender sequences, recorded through this very
class with `forward_to` a real vLLM): each is served like a fixture of its own. `lockstep` makes a streamed
`/inference/v1/generate` send its next chunk only once the derender of the previous one has arrived, so the
gateway derenders one chunk at a time in replay exactly as it did while recording, whatever the machine's load.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

from aiohttp import ClientSession, web

from gateway.proxy import chat_templates
from gateway.proxy.sampling import NEUTRAL

FIXTURES = Path(__file__).parents[1] / "fixtures" / "vllm"
RENDER = "/v1/chat/completions/render"
# SmolLM2's template ignores tools: both of token_in's probes render alike.
SMOLLM2_PROBE: list[int] = next(
    entry["probe_token_ids"][0]
    for entry in json.loads(chat_templates.REGISTRY.read_text())["templates"].values()
    if entry["name"] == "smollm2"
)


def load_fixtures(directory: Path = FIXTURES) -> dict[str, dict[str, Any]]:
    """Every recording by name; a file of `exchanges` gives one entry per exchange (`<name>#<i>`)."""
    fixtures: dict[str, dict[str, Any]] = {}
    for path in sorted(directory.glob("*.json")):
        fixture = json.loads(path.read_text())
        fixtures[path.stem] = fixture
        for i, exchange in enumerate(fixture.get("exchanges") or ()):
            fixtures[f"{path.stem}#{i}"] = {"path": fixture["path"], "stream": False, **exchange}
            fixtures[f"{path.stem}#{i}"].setdefault("headers", {"content-type": "application/json"})
    return fixtures


_TRUE = (True, 1, "1", "on", "t", "true", "y", "yes")


def _without_sampling(body: Any) -> Any:
    """The body as matched: sampling parameters left out, and `stream` read the way vLLM's pydantic model reads it
    ("true", 1 and "yes" stream)."""
    if not isinstance(body, dict):
        return body
    out = {k: v for k, v in body.items() if k not in NEUTRAL}
    if isinstance(out.get("chat_request"), dict):  # token_in's derender carries the chat request as sent
        out["chat_request"] = _without_sampling(out["chat_request"])
    for generated in ("generate_response", "generate_chunk"):
        # ... and the generate answer it derenders, whose id and clock vLLM picks anew for every request
        if isinstance(out.get(generated), dict):
            out[generated] = {k: v for k, v in out[generated].items() if k not in ("request_id", "created")}
    if "stream" in out:
        flag = out["stream"]
        out["stream"] = (flag.lower() if isinstance(flag, str) else flag) in _TRUE
    return out


class FakeUpstream:
    """Runs an aiohttp server on its own thread and loop; tests read `received` and set `mode`."""

    def __init__(
        self,
        fixtures: dict[str, dict[str, Any]] | None = None,
        chunk_delay_s: float = 0.0,
        forward_to: str | None = None,
    ) -> None:
        self.fixtures = fixtures if fixtures is not None else load_fixtures()
        self.chunk_delay_s = chunk_delay_s
        # Recording: requests no fixture answers go to this real vLLM (root URL) and land in `recorded`.
        self.forward_to = forward_to
        self.recorded: list[dict[str, Any]] = []
        self.lockstep = True
        self._derenders = 0
        self.mode = "replay"  # replay | error500 | fail_once (one 500, then replay) | hang | cut_stream | slow_stream | forbidden
        self.received: list[dict[str, Any]] = []
        # LoRA adapters /v1/models lists besides the recorded base model (a replica that restarted has none).
        self.adapters: list[str] = []
        # Adapters unloaded from this vLLM: a call naming one is answered 404 as vLLM answers it.
        self.retired: set[str] = set()
        self.cancelled_streams = 0
        # What token_in's template probe renders to (gateway/proxy/chat_templates.py); another template's, to test others.
        self.probe_token_ids = SMOLLM2_PROBE
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
        response = fixture["response"]
        if self.adapters:  # listed as vLLM lists a LoRA adapter: the base entry under the adapter's name
            base = response["data"][0]
            extra = [{**base, "id": name, "root": name, "parent": base["id"]} for name in self.adapters]
            response = {**response, "data": [*response["data"], *extra]}
        return web.json_response(response)

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
        if body.get("model") in self.retired:
            message = f"The model `{body['model']}` does not exist."
            return web.json_response(
                {"object": "error", "message": message, "type": "NotFoundError", "param": None, "code": 404}, status=404
            )
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "forbidden":  # vLLM's scale-out endpoints without --enable-scale-out
            return web.json_response({"detail": "Forbidden"}, status=403)
        if request.path.endswith("/derender") and body.get("stream"):  # a logprobs derender runs beside it
            self._derenders += 1
        fixture = self._match(request.path, body)
        if fixture is None and request.path == RENDER and body.get("messages") == chat_templates.PROBE_MESSAGES:
            # token_in's template probe, for any served name: the ids real vLLM renders for SmolLM2's template
            answer = {"token_ids": self.probe_token_ids, "sampling_params": {}}
            return web.json_response(answer)
        if fixture is None and self.forward_to is not None:
            return await self._forward(request, body)
        if fixture is None:
            message = f"fake upstream: no recorded response for {request.path} with body {json.dumps(body)[:400]}"
            return web.json_response({"error": {"message": message, "type": "NoFixture", "code": 418}}, status=418)
        if not fixture.get("stream") or fixture.get("status") != 200:
            content_type = fixture.get("headers", {}).get("content-type", "application/json")
            response = fixture["response"]
            text = response if isinstance(response, str) else json.dumps(response)
            return web.Response(status=fixture["status"], body=text.encode(), headers={"content-type": content_type})
        return await self._stream(request, fixture["chunks"])

    async def _in_step(self, request: web.Request, derenders_before: int, position: int) -> None:
        """In lockstep, a token_in generate stream waits for the derender of each chunk it sent."""
        if not (self.lockstep and request.path.endswith("/generate")):
            return
        deadline = asyncio.get_running_loop().time() + 10
        while self._derenders < derenders_before + position and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.002)

    async def _forward(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        """Recording: ask the real vLLM, keep the exchange, answer as it did."""
        exchange: dict[str, Any] = {"path": request.path, "request": body}
        self.recorded.append(exchange)
        async with (
            ClientSession() as session,
            session.post(self.forward_to + request.path, json=body) as upstream,
        ):
            content_type = upstream.headers.get("content-type", "")
            exchange["status"] = upstream.status
            if not (body.get("stream") and content_type.startswith("text/event-stream")):
                text = await upstream.text()
                exchange.update(stream=False, response=json.loads(text) if "json" in content_type else text)
                headers = {"content-type": content_type}
                return web.Response(status=upstream.status, body=text.encode(), headers=headers)
            chunks: list[str] = []
            exchange.update(stream=True, chunks=chunks)
            response = web.StreamResponse(status=200, headers={"content-type": content_type})
            await response.prepare(request)
            derenders_before = self._derenders
            buffer = b""
            async for data in upstream.content.iter_any():
                buffer += data
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.startswith(b"data: "):
                        await self._in_step(request, derenders_before, len(chunks))
                        chunks.append(line[6:].decode())
                        await response.write(line + b"\n\n")
            await response.write_eof()
            return response

    async def _stream(self, request: web.Request, chunks: list[str]) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers={"content-type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        derenders_before = self._derenders
        try:
            for position, payload in enumerate(chunks):
                await self._in_step(request, derenders_before, position)
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
            app.router.add_post("/inference/v1/{tail:.*}", self._post)
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
        self._loop = None  # stopped for good: a second stop (a test that stopped it, then its fixture) is a no-op
