"""A very fast vLLM-shaped fake upstream for benchmarks (not for tests: it answers every request the same way).

Raw asyncio protocol on uvloop with httptools parsing, HTTP/1.1 keep-alive, and responses pre-rendered to bytes at
start-up, so it costs a few microseconds per request and the gateway, not the upstream, is what a benchmark sees.

    POST /v1/chat/completions   canned chat completion; a body containing `"stream": true` gets canned SSE chunks
    POST /v1/completions        canned text completion / SSE (when the fixtures have them)
    GET  /v1/models             the recorded model list

Every canned body comes from tests/fixtures/vllm/*.json, recorded from the real vLLM CPU server (format: the top
of scripts/record_fixtures.py). docs/design.md §14 measures with `max_tokens 16`, so by default the non-stream chat
answer is
the recorded plain-text chat answer (no tool call, n=1, status 200) whose completion length is closest to 16 tokens,
sent byte-for-byte. The recorded chat streams are shorter, so the stream is rendered in the exact framing of the
recorded `chat_stream` (role chunk with `prompt_token_ids`, one chunk per token with its `token_ids` and logprobs,
EOS in an empty-delta finish chunk, a usage chunk with `system_fingerprint`, `[DONE]`) filled with that same
recorded completion, so stream and non-stream carry the same tokens. `--verbatim` replays `chat.json` and
`chat_stream.json` byte-for-byte instead.

    python bench/fast_upstream.py --port 8101 [--max-tokens 16] [--verbatim] [--chunk-delay-ms 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httptools
import uvloop

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "vllm"
CHAT_PATH = b"/v1/chat/completions"
COMPLETIONS_PATH = b"/v1/completions"
MODELS_PATH = b"/v1/models"


# ---------------------------------------------------------------------------------------------------------------
# Canned responses, rendered once


def _compact(value: Any) -> str:
    """JSON the way vLLM (pydantic) writes it: no spaces, non-ASCII as is."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _http_json(body: bytes, status: int = 200, reason: bytes = b"OK") -> bytes:
    return (
        b"HTTP/1.1 %d %s\r\nserver: uvicorn\r\ncontent-length: %d\r\ncontent-type: application/json\r\n\r\n"
        % (status, reason, len(body))
    ) + body


_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nserver: uvicorn\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)


def _sse_chunks(payloads: list[str]) -> list[bytes]:
    """Each SSE event as one HTTP/1.1 chunk (as uvicorn sends vLLM's stream), then the terminating chunk."""
    out = []
    for payload in payloads:
        event = b"data: " + payload.encode() + b"\n\n"
        out.append(b"%x\r\n%s\r\n" % (len(event), event))
    out.append(b"0\r\n\r\n")
    return out


def load_fixtures(directory: Path) -> dict[str, dict[str, Any]]:
    return {path.stem: json.loads(path.read_text()) for path in sorted(directory.glob("*.json"))}


def _is_plain_chat_answer(fixture: dict[str, Any]) -> bool:
    if fixture.get("path") != "/v1/chat/completions" or fixture.get("status") != 200 or fixture.get("stream"):
        return False
    request, response = fixture.get("request") or {}, fixture.get("response")
    if not isinstance(response, dict) or request.get("n", 1) != 1 or request.get("top_logprobs"):
        return False
    choices = response.get("choices") or []
    if len(choices) != 1 or not response.get("prompt_token_ids"):
        return False
    choice = choices[0]
    message = choice.get("message") or {}
    content = (choice.get("logprobs") or {}).get("content") or []
    return bool(message.get("content")) and not message.get("tool_calls") and len(content) == len(
        choice.get("token_ids") or []
    ) > 0


def pick_chat_fixture(fixtures: dict[str, dict[str, Any]], max_tokens: int) -> str:
    """The plain chat answer closest to `max_tokens` completion tokens (not over it when one fits)."""
    candidates = [name for name, fixture in fixtures.items() if _is_plain_chat_answer(fixture)]
    if not candidates:
        raise SystemExit(f"fast_upstream: no plain non-stream chat fixture in {FIXTURES}")

    def length(name: str) -> int:
        return len(fixtures[name]["response"]["choices"][0]["token_ids"])

    return min(candidates, key=lambda name: (length(name) > max_tokens, abs(length(name) - max_tokens), name))


def stream_from_answer(template: list[str], answer: dict[str, Any]) -> list[str]:
    """A chat stream in the recorded stream's framing, carrying a recorded non-stream answer's tokens.

    The template is a recorded vLLM chat stream (`stream_options.include_usage`, logprobs, return_token_ids).
    Its first event (role + prompt_token_ids), a content-token event, the finish event and the usage event are
    the shapes; ids, text, logprobs, usage and fingerprint come from the answer.
    """
    events = [json.loads(payload) for payload in template if payload != "[DONE]"]
    role = next(e for e in events if e.get("prompt_token_ids") is not None)
    token_events = [e for e in events if e.get("choices") and e["choices"][0].get("token_ids")]
    content_event = next(e for e in token_events if e["choices"][0].get("delta", {}).get("content"))
    finish_event = next(e for e in token_events if e["choices"][0].get("finish_reason") is not None)
    usage_event = next(e for e in events if e.get("usage") is not None and not e.get("choices"))

    choice = answer["choices"][0]
    ids: list[int] = choice["token_ids"]
    entries: list[dict[str, Any]] = choice["logprobs"]["content"]
    text: str = choice["message"]["content"]
    # The EOS token's text is not part of the content; vLLM sends it in an empty-delta finish chunk.
    eos_separate = "".join(e["token"] for e in entries[:-1]) == text
    if not eos_separate and "".join(e["token"] for e in entries) != text:
        raise ValueError("the answer's token strings do not spell its content")

    head = {"id": answer["id"], "created": answer["created"], "model": answer["model"]}

    def event(template_event: dict[str, Any], **changes: Any) -> dict[str, Any]:
        out = json.loads(json.dumps(template_event))
        for key, value in head.items():
            if key in out:
                out[key] = value
        out.update(changes)
        return out

    payloads = [_compact(event(role, prompt_token_ids=answer["prompt_token_ids"]))]
    body_tokens = len(ids) - 1 if eos_separate else len(ids)
    for position in range(len(ids)):
        last = position == len(ids) - 1
        if last:
            out = event(finish_event)
            out_choice = out["choices"][0]
            out_choice["delta"] = {} if eos_separate else {"content": entries[position]["token"]}
            out_choice["finish_reason"] = choice["finish_reason"]
            out_choice["stop_reason"] = choice.get("stop_reason")
        else:
            assert position < body_tokens
            out = event(content_event)
            out_choice = out["choices"][0]
            out_choice["delta"] = {"content": entries[position]["token"]}
        out_choice["logprobs"] = {"content": [entries[position]]}
        out_choice["token_ids"] = [ids[position]]
        payloads.append(_compact(out))
    usage = answer.get("usage") or {}
    payloads.append(
        _compact(
            event(
                usage_event,
                usage={k: usage.get(k) for k in usage_event["usage"]},
                system_fingerprint=answer.get("system_fingerprint", usage_event.get("system_fingerprint")),
            )
        )
    )
    payloads.append("[DONE]")
    return payloads


@dataclass
class Canned:
    models: bytes
    not_found: bytes
    # path -> (non-stream response bytes, stream response chunks: head first, then one per SSE event)
    routes: dict[bytes, tuple[bytes, list[bytes]]] = field(default_factory=dict)
    served_model: str = ""
    description: str = ""
    unknown_paths: set[bytes] = field(default_factory=set)


def build_canned(directory: Path = FIXTURES, max_tokens: int = 16, verbatim: bool = False) -> Canned:
    fixtures = load_fixtures(directory)
    missing = [name for name in ("chat_stream", "models") if name not in fixtures]
    if missing:
        raise SystemExit(f"fast_upstream: fixtures missing from {directory}: {', '.join(missing)}")
    stream_template = fixtures["chat_stream"]["chunks"]
    if verbatim:
        name = "chat"
        answer_fixture = fixtures[name]
        chunks = list(stream_template)
    else:
        name = pick_chat_fixture(fixtures, max_tokens)
        answer_fixture = fixtures[name]
        chunks = stream_from_answer(stream_template, answer_fixture["response"])
    answer = answer_fixture["response"]
    non_stream = _http_json(answer_fixture["raw_body"].encode())
    stream = [_SSE_HEAD, *_sse_chunks(chunks)]
    canned = Canned(
        models=_http_json(fixtures["models"]["raw_body"].encode()),
        not_found=_http_json(b'{"detail":"Not Found"}', 404, b"Not Found"),
        served_model=answer["model"],
    )
    canned.routes[CHAT_PATH] = (non_stream, stream)
    completion_tokens = len(answer["choices"][0]["token_ids"])
    canned.description = (
        f"chat: {name}.json ({completion_tokens} completion tokens, {len(answer['prompt_token_ids'])} prompt tokens, "
        f"{len(non_stream)} B); stream: {len(chunks) - 1} events "
        f"({'chat_stream.json verbatim' if verbatim else 'chat_stream.json framing, same tokens'}, "
        f"{sum(len(c) for c in stream)} B)"
    )
    if "completions" in fixtures and "completions_stream" in fixtures:
        canned.routes[COMPLETIONS_PATH] = (
            _http_json(fixtures["completions"]["raw_body"].encode()),
            [_SSE_HEAD, *_sse_chunks(fixtures["completions_stream"]["chunks"])],
        )
    return canned


# ---------------------------------------------------------------------------------------------------------------
# The server


class UpstreamProtocol(asyncio.Protocol):
    __slots__ = ("canned", "chunk_delay_s", "transport", "parser", "url", "body", "loop")

    def __init__(self, canned: Canned, chunk_delay_s: float) -> None:
        self.canned = canned
        self.chunk_delay_s = chunk_delay_s
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.loop = asyncio.get_event_loop()

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.write(_http_json(b'{"detail":"bad request"}', 400, b"Bad Request"))
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        transport = self.transport
        if transport is None:
            return
        method = self.parser.get_method()
        path = self.url.split(b"?", 1)[0]
        if method == b"POST" and path in self.canned.routes:
            non_stream, stream = self.canned.routes[path]
            body = b"".join(self.body) if len(self.body) != 1 else self.body[0]
            if b'"stream":true' in body or b'"stream": true' in body:
                if self.chunk_delay_s > 0:
                    self._trickle(stream, 0)
                else:
                    transport.write(b"".join(stream))
            else:
                transport.write(non_stream)
        elif method == b"GET" and path == MODELS_PATH:
            transport.write(self.canned.models)
        else:
            transport.write(self.canned.not_found)
            if path not in self.canned.unknown_paths and len(self.canned.unknown_paths) < 100:
                self.canned.unknown_paths.add(path)
                print(f"fast_upstream: 404 for {method.decode()} {path.decode(errors='replace')}", flush=True)
        if not self.parser.should_keep_alive():
            transport.close()

    def _trickle(self, stream: list[bytes], position: int) -> None:
        """Send the head and the first event now and one event per delay after (`--chunk-delay-ms`)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if position == 0:
            transport.write(stream[0] + stream[1])
            position = 2
        else:
            transport.write(stream[position])
            position += 1
        if position < len(stream):
            self.loop.call_later(self.chunk_delay_s, self._trickle, stream, position)


async def serve(host: str, port: int, canned: Canned, chunk_delay_s: float) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: UpstreamProtocol(canned, chunk_delay_s), host, port, backlog=4096, reuse_address=True
    )
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"fast_upstream listening on http://{host}:{port}/v1 model={canned.served_model}; {canned.description}",
          flush=True)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--fixtures", type=Path, default=FIXTURES, help="directory of recorded vLLM fixtures")
    parser.add_argument("--max-tokens", type=int, default=16, help="pick the recorded answer closest to this size")
    parser.add_argument("--verbatim", action="store_true", help="replay chat.json / chat_stream.json byte-for-byte")
    parser.add_argument("--chunk-delay-ms", type=float, default=0.0, help="gap between SSE events (0: all at once)")
    parser.add_argument("--describe", action="store_true", help="print what would be served and exit")
    args = parser.parse_args(argv)
    canned = build_canned(args.fixtures, args.max_tokens, args.verbatim)
    if args.describe:
        print(f"model={canned.served_model}; {canned.description}")
        return 0
    uvloop.run(serve(args.host, args.port, canned, args.chunk_delay_ms / 1000))
    return 0


if __name__ == "__main__":
    sys.exit(main())
