"""A scripted OpenAI-compatible server for the example agents' tool loops, without vLLM: it answers with replies of the
shape real vLLM gave (tests/fixtures/vllm, recorded with the hermes parser), edited to say what a test needs, and
keeps each request. The tool agent's tests, its LangGraph twin's and the demo's trivia episode run against it (the
`scripted` fixture in tests/conftest.py starts them)."""

from __future__ import annotations

import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import openai

from tests.support.examples import load_example
from tests.support.fake_upstream import load_fixtures

agent = load_example("tool_agent")  # once, so every test and the LangGraph twin see the same module and classes
FIXTURES = load_fixtures()


def tool_reply(name: str, arguments: str) -> dict[str, Any]:
    """A tool call as vLLM's hermes parser returns it: the recorded reply with another call in it."""
    body = copy.deepcopy(FIXTURES["conversation_turn2_tool_call"]["response"])
    body["choices"][0]["message"]["tool_calls"][0]["function"] = {"name": name, "arguments": arguments}
    return body


def text_reply(text: str) -> dict[str, Any]:
    body = copy.deepcopy(FIXTURES["conversation_turn3"]["response"])
    assert not body["choices"][0]["message"].get("tool_calls")
    body["choices"][0]["message"]["content"] = text
    return body


class Scripted:
    """An OpenAI-compatible server on 127.0.0.1 whose /chat/completions answers with the next scripted reply and
    keeps each request: a real socket, so any client (the OpenAI SDK, LangChain) talks to it as to the gateway."""

    def __init__(self, replies: list[dict[str, Any]], version: int = 3) -> None:
        self.replies = list(replies)
        self.requests: list[dict[str, Any]] = []
        scripted = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the name http.server looks for
                assert self.path.endswith("/chat/completions"), self.path
                scripted.requests.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
                body = json.dumps(scripted.replies.pop(0)).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.send_header("x-policy-version", str(version))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def client(self) -> openai.OpenAI:
        port = self.server.server_address[1]
        return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/g/x/n/1/t/x-t0/v1", api_key="none", max_retries=0)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def person_of(question: Any) -> Any:
    return next(p for p in agent.DIRECTORY.people if p.id == question.person_id)
