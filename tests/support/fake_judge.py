"""An OpenAI-compatible judge model for fast tests: it answers POST /v1/chat/completions with a script of responses
(recorded from real vLLM under tests/fixtures/judge/, or hand-made ones, which say so), one per request, and keeps
what it received."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

from aiohttp import web

JUDGE_FIXTURES = Path(__file__).parents[1] / "fixtures" / "judge"


def judge_fixture(name: str) -> dict[str, Any]:
    fixture: dict[str, Any] = json.loads((JUDGE_FIXTURES / f"{name}.json").read_text())
    return fixture


def chat_completion(content: str | None, finish_reason: str = "stop", model: str = "smollm2") -> dict[str, Any]:
    """A chat completion body around `content`, shaped like vLLM's."""
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish_reason}
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


def scores_answer(scores: dict[str, float], explanation: str = "hand-made answer for a test") -> str:
    return json.dumps(
        {"scores": [{"trajectory_id": t, "score": s, "explanation": explanation} for t, s in scores.items()]}
    )


def schema_ids(body: dict[str, Any]) -> list[str]:
    """The trajectory ids the judge's response_format schema asks for, in order."""
    schema = body["response_format"]["json_schema"]["schema"]
    return [item["properties"]["trajectory_id"]["const"] for item in schema["properties"]["scores"]["prefixItems"]]


class FakeJudge:
    def __init__(self) -> None:
        self.script: list[tuple[int, Any]] = []
        # With an empty script: answer every request with valid, hand-made scores for the ids its schema names.
        self.auto = False
        self.received: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self.headers: list[dict[str, str]] = []
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def reset(self, *responses: tuple[int, Any], auto: bool = False) -> FakeJudge:
        self.script = list(responses)
        self.auto = auto
        self.received.clear()
        self.paths.clear()
        self.headers.clear()
        return self

    def answer(self, content: str | None, finish_reason: str = "stop") -> tuple[int, Any]:
        return 200, chat_completion(content, finish_reason)

    @staticmethod
    def replay(name: str) -> tuple[int, Any]:
        """A response from tests/fixtures/judge (recorded from vLLM, or hand-made where the file says so)."""
        fixture = judge_fixture(name)
        return fixture["status"], fixture["response"]

    async def _post(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.received.append(body)
        self.paths.append(request.path)
        self.headers.append(dict(request.headers))
        if not self.script and self.auto:
            ids = schema_ids(body)
            scores = {t: round(1 - i / len(ids), 3) for i, t in enumerate(ids)}
            return web.json_response(chat_completion(scores_answer(scores, "hand-made by the fake judge")))
        if not self.script:
            error = {"error": {"message": "fake judge: script exhausted", "type": "NoScript", "code": 418}}
            return web.json_response(error, status=418)
        status, payload = self.script.pop(0)
        return web.json_response(payload, status=status)

    def start(self) -> FakeJudge:
        ready = threading.Event()

        async def boot() -> None:
            app = web.Application()
            app.router.add_post("/v1/chat/completions", self._post)
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

        self._thread = threading.Thread(target=run, name="fake-judge", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fake judge did not start")
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


def judge_block(fake: FakeJudge, **overrides: Any) -> dict[str, Any]:
    """A run's `judge` config pointed at the fake. The built-in client, so the tests behave the same with or without
    litellm installed."""
    return {"model": "hosted_vllm/smollm2", "api_base": fake.base_url, "client": "builtin", "backoff_s": 0.0,
            **overrides}  # fmt: skip
