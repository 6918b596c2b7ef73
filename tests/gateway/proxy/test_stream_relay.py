"""The stream relay's fast path against the straightforward one it replaced.

`StreamAssembler.feed` is written for the common chunk and strips the client's copy in the same pass, and the relay
(`Proxy._relay_stream`) relies on it for every SSE event. Neither the bytes a client receives nor the record written
may differ from what the plain implementation gives: `ReferenceAssembler` below is that implementation (assemble
first, then `strip_for_client`), and every stream here — the recorded ones, hand-made shapes vLLM can send (n > 1,
tool calls, reasoning, usage, errors mid-stream, cut streams, malformed events) and seeded random variations of the
recordings — goes through the real relay once with each and every combination of what the client asked.
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import asdict
from typing import Any

import orjson
import pytest

from bench.fast_upstream import pick_chat_fixture, stream_from_answer
from gateway.proxy import capture
from gateway.proxy.capture import ClientAsks, StreamAssembler, _ChoiceParts, strip_for_client
from gateway.store.models import CHAT, COMPLETIONS
from tests.support.fake_upstream import load_fixtures
from tests.support.stream_relay import relay, relay_proxy, sse_reads

FIXTURES = load_fixtures()
ALL_ASKS = [ClientAsks(logprobs=lp, token_ids=ids) for lp in (False, True) for ids in (False, True)]
TIMING = ("latency_ms", "ttft_ms", "created_at")


class ReferenceAssembler(StreamAssembler):
    """The assembler as it was before the fast path: every key fetched, every delta read in full; with `strip`,
    `strip_for_client` afterwards, as the relay used to call it. (`response` is the assembler's own, unchanged.)"""

    def __init__(self, endpoint: str, strip: ClientAsks | None = None) -> None:
        super().__init__(endpoint)
        self.strip = strip

    def feed(self, chunk: dict[str, Any]) -> None:
        self.chunks += 1
        if not self.head:
            self.head = {k: chunk.get(k) for k in ("id", "created", "model")}
        if chunk.get("system_fingerprint") is not None:
            self.head["system_fingerprint"] = chunk["system_fingerprint"]
        if chunk.get("prompt_token_ids") is not None:
            self.prompt_token_ids = chunk["prompt_token_ids"]
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            index = choice.get("index", 0)
            parts = self._choices.get(index)
            if parts is None:
                parts = self._choices[index] = _ChoiceParts()
            if choice.get("prompt_token_ids") is not None:
                parts.prompt_token_ids = choice["prompt_token_ids"]
            if choice.get("token_ids"):
                parts.token_ids.extend(choice["token_ids"])
            logprobs = choice.get("logprobs")
            if logprobs:
                parts.has_logprobs = True
                key = "content" if self.endpoint == CHAT else "token_logprobs"
                parts.logprob_entries.extend(logprobs.get(key) or ())
            if choice.get("finish_reason") is not None:
                parts.finish_reason = choice["finish_reason"]
            if choice.get("stop_reason") is not None:
                parts.stop_reason = choice["stop_reason"]
            if self.endpoint == CHAT:
                self._feed_delta(parts, choice.get("delta") or {})
            elif choice.get("text"):
                parts.text.append(choice["text"])
        if self.strip is not None:
            strip_for_client(chunk, self.strip)

    @staticmethod
    def _feed_delta(parts: _ChoiceParts, delta: dict[str, Any]) -> None:
        """The whole delta: its content here, the rest (role, reasoning, tool calls: unchanged) as the assembler does."""
        if delta.get("content"):
            parts.text.append(delta["content"])
        StreamAssembler._feed_delta(parts, delta)


# ---------------------------------------------------------------------------------------------------------------
# Streams: (endpoint, SSE data payloads)


def _recorded(name: str) -> tuple[str, list[str]]:
    fixture = FIXTURES[name]
    return (CHAT if fixture["path"] == "/v1/chat/completions" else COMPLETIONS), list(fixture["chunks"])


def _events(payloads: list[str]) -> list[dict[str, Any]]:
    return [json.loads(p) for p in payloads if p != "[DONE]"]


def _render(events: list[dict[str, Any]], done: bool = True) -> list[str]:
    """Payloads written the way vLLM writes them (compact, non-ASCII as is)."""
    payloads = [json.dumps(e, separators=(",", ":"), ensure_ascii=False) for e in events]
    return [*payloads, "[DONE]"] if done else payloads


def _n2(endpoint: str, payloads: list[str]) -> list[str]:
    """A recorded stream as n=2 sends it: each choice event followed by the same for choice 1 with other text."""
    out: list[dict[str, Any]] = []
    for event in _events(payloads):
        out.append(event)
        if event.get("choices"):
            twin = copy.deepcopy(event)
            for choice in twin["choices"]:
                choice["index"] = 1
                if endpoint == CHAT and (choice.get("delta") or {}).get("content"):
                    choice["delta"]["content"] += "é"
                elif choice.get("text"):
                    choice["text"] += "ü"
                if choice.get("token_ids"):
                    choice["token_ids"] = [i + 1 for i in choice["token_ids"]]
            out.append(twin)
    return _render(out)


def _head(i: int = 0) -> dict[str, Any]:
    return {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1795242773 + i, "model": "m"}


def _lp(token: str, value: float) -> dict[str, Any]:
    return {"content": [{"token": token, "logprob": value, "bytes": list(token.encode()), "top_logprobs": []}]}


def _tool_call_stream() -> list[str]:
    """OpenAI-style tool-call deltas (id and name first, arguments in fragments), two calls, reasoning first."""
    choice = {"index": 0, "logprobs": None, "finish_reason": None}
    events = [
        {**_head(), "choices": [{**choice, "delta": {"role": "assistant", "content": None}}],
         "prompt_token_ids": [1, 2]},
        {**_head(), "choices": [{**choice, "delta": {"reasoning_content": "think"}, "logprobs": _lp("think", -0.5),
                                 "token_ids": [7]}]},
        {**_head(), "choices": [{**choice, "delta": {"reasoning": " more"}, "token_ids": [8]}]},
        {**_head(), "choices": [{**choice, "delta": {"tool_calls": [
            {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_", "arguments": ""}}]}}]},
        {**_head(), "choices": [{**choice, "delta": {"tool_calls": [
            {"index": 0, "function": {"name": "weather", "arguments": "{\"city\":"}}]}, "token_ids": [9, 10],
            "logprobs": {"content": [_lp("a", -1e-05)["content"][0], _lp("b", -2.5e-7)["content"][0]]}}]},
        {**_head(), "choices": [{**choice, "delta": {"tool_calls": [
            {"index": 1, "id": "call_2", "function": {"name": "time", "arguments": "{}"}}], "content": "x"}}]},
        {**_head(), "choices": [{**choice, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": "\"Paris\"}"}}]}}]},
        {**_head(), "choices": [{**choice, "delta": {}, "finish_reason": "tool_calls", "stop_reason": None,
                                 "token_ids": [2], "logprobs": _lp("<|im_end|>", -0.01)}]},
        {**_head(), "choices": [], "usage": {"prompt_tokens": 2, "total_tokens": 7, "completion_tokens": 5},
         "system_fingerprint": "fp"},
    ]
    return _render(events)


def _odd_shapes() -> list[str]:
    """Keys present but null or empty, missing keys, usage beside choices, content and role together."""
    events = [
        {**_head(), "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}, "logprobs": {},
                                 "token_ids": [], "finish_reason": None}], "prompt_token_ids": None,
         "system_fingerprint": None},
        {**_head(), "choices": [{"delta": {"content": ""}, "logprobs": {"content": None}, "token_ids": None}]},
        {**_head(), "choices": [{"index": 0, "delta": {"content": None}, "logprobs": None}]},
        {**_head(), "choices": [{"index": 0, "delta": None, "token_ids": [5], "logprobs": _lp("!", -3.0)}]},
        {**_head(), "choices": [{"index": 0}], "usage": None},
        {**_head(), "choices": None},
        {**_head()},
        {**_head(), "choices": [{"index": 0, "delta": {"content": "ok", "refusal": None}, "token_ids": [6],
                                 "logprobs": _lp("ok", -0.25), "finish_reason": "stop", "stop_reason": 13}],
         "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}, "system_fingerprint": "fp2"},
    ]
    return _render(events)


def _completions_n2() -> list[str]:
    """Completions with n=2: prompt ids on each choice's first event, `stop_reason` on every event."""
    events = []
    for step, (text, tid) in enumerate([(" Paris", 7042), (".", 30)]):
        for index in (0, 1):
            events.append({**_head(step), "object": "text_completion", "choices": [{
                "index": index, "text": text, "logprobs": {"text_offset": [0], "token_logprobs": [-0.1 * (index + 1)],
                                                           "tokens": [text], "top_logprobs": [{text: -0.1}]},
                "finish_reason": "length" if step else None, "stop_reason": None,
                "prompt_token_ids": [504, 3575] if step == 0 else None, "token_ids": [tid + index]}]})
    events.append({**_head(), "object": "text_completion", "choices": [], "usage": {"prompt_tokens": 2}})
    return _render(events)


def _with_errors(payloads: list[str]) -> list[str]:
    """An upstream error event and a line that is not JSON in the middle; an event with both error and choices."""
    events = _render(_events(payloads), done=False)
    middle = len(events) // 2
    error = json.dumps({"error": {"message": "boom", "type": "BadRequestError", "code": 400}})
    both = json.loads(events[middle])
    both["error"] = None
    return [*events[:middle], error, "{not json", json.dumps(both), *events[middle:], "[DONE]"]


def _cut(payloads: list[str]) -> list[str]:
    """A stream that stops without [DONE]."""
    return payloads[: len(payloads) // 2]


def _malformed() -> list[str]:
    """Events that are JSON but not the expected shape: the relay fails the stream, and must fail it the same way."""
    good = _events(FIXTURES["chat_stream"]["chunks"])
    return [
        [json.dumps(good[0]), json.dumps(good[1]), '"a string with usage and system_fingerprint"', "[DONE]"],
        [json.dumps(good[0]), "[1, 2]", "[DONE]"],
        [json.dumps(good[0]), json.dumps({**_head(), "choices": [["token_ids"]]}), "[DONE]"],
        [json.dumps(good[0]), json.dumps({**_head(), "choices": [{"index": 0, "delta": "text", "token_ids": [1]}]})],
        [json.dumps(good[0]), json.dumps({**_head(), "choices": [{"index": 0, "token_ids": [3], "logprobs": [1]}]})],
        [json.dumps(good[0]), json.dumps({**_head(), "choices": [{"index": 0, "token_ids": 5}]})],
        [json.dumps(good[0]), json.dumps({**_head(), "choices": [{"index": 0, "delta": {"content": "a",
                                                                                          "tool_calls": "xy"}}]})],
        ["12", "[DONE]"],
    ]


def _mutated(rng: random.Random, endpoint: str, payloads: list[str]) -> list[str]:
    """A recorded stream with keys randomly dropped, nulled or emptied, and deltas given extra fields."""
    events = _events(payloads)
    for event in events:
        for key in ("prompt_token_ids", "usage", "system_fingerprint", "id", "model"):
            if key in event and rng.random() < 0.15:
                if rng.random() < 0.5:
                    del event[key]
                else:
                    event[key] = None
        for choice in event.get("choices") or ():
            for key in ("token_ids", "logprobs", "finish_reason", "stop_reason", "delta", "text", "index",
                        "prompt_token_ids"):
                roll = rng.random()
                if key in choice and roll < 0.1:
                    del choice[key]
                elif key in choice and roll < 0.2:
                    choice[key] = None
                elif key in ("token_ids", "logprobs") and roll < 0.25:
                    choice[key] = [] if key == "token_ids" else {}
            delta = choice.get("delta")
            if endpoint == CHAT and isinstance(delta, dict):
                roll = rng.random()
                if roll < 0.1:
                    delta["role"] = "assistant"
                elif roll < 0.2:
                    delta["reasoning_content"] = "r"
                elif roll < 0.25:
                    delta["content"] = None
                elif roll < 0.3:
                    delta["tool_calls"] = [{"index": rng.randrange(2), "function": {"arguments": "{"}}]
            if rng.random() < 0.05:
                choice["index"] = 1
    rendered = _render(events)
    return rendered if rng.random() < 0.9 else rendered[: rng.randrange(1, len(rendered))]


def _bench_stream() -> list[str]:
    answer = FIXTURES[pick_chat_fixture(FIXTURES, 16)]["response"]
    return stream_from_answer(FIXTURES["chat_stream"]["chunks"], answer)


def _streams() -> dict[str, tuple[str, list[str]]]:
    recorded = {name: _recorded(name) for name in ("chat_stream", "chat_tools_stream", "completions_stream")}
    streams = dict(recorded)
    streams["bench_stream"] = (CHAT, _bench_stream())
    for name, (endpoint, payloads) in recorded.items():
        streams[f"{name}_n2"] = (endpoint, _n2(endpoint, payloads))
        streams[f"{name}_errors"] = (endpoint, _with_errors(payloads))
        streams[f"{name}_cut"] = (endpoint, _cut(payloads))
    streams["tool_call_deltas"] = (CHAT, _tool_call_stream())
    streams["odd_shapes"] = (CHAT, _odd_shapes())
    streams["odd_shapes_as_completions"] = (COMPLETIONS, _odd_shapes())
    streams["completions_n2"] = (COMPLETIONS, _completions_n2())
    for i, payloads in enumerate(_malformed()):
        streams[f"malformed_{i}"] = (CHAT, payloads)
    rng = random.Random(18)
    for i in range(60):
        name = rng.choice(list(recorded))
        endpoint, payloads = recorded[name]
        streams[f"random_{i}_{name}"] = (endpoint, _mutated(rng, endpoint, payloads))
    return streams


STREAMS = _streams()


def _asks_id(asks: ClientAsks) -> str:
    return f"logprobs={int(asks.logprobs)},token_ids={int(asks.token_ids)}"


async def _outcome(reads: list[bytes], endpoint: str, asks: ClientAsks) -> dict[str, Any]:
    """Everything observable of one relayed stream: the body, the records, the call's error, or what it raised."""
    proxy, writer = relay_proxy()
    bodies: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            bodies.append(message["body"])

    outcome: dict[str, Any] = {}
    try:
        call = await relay(proxy, reads, endpoint, asks, send)
    except Exception as exc:  # a stream the record cannot be assembled from fails in submit, and must fail alike
        outcome["raised"] = repr(exc)
    else:
        outcome["error"] = call.error
        outcome["ttft"] = call.first_chunk is not None
    outcome["body"] = b"".join(bodies)
    outcome["records"] = [{k: v for k, v in asdict(r).items() if k not in TIMING} for r in writer.records]
    return outcome


@pytest.mark.parametrize("asks", ALL_ASKS, ids=_asks_id)
@pytest.mark.parametrize("name", list(STREAMS))
async def test_relay_matches_reference(name: str, asks: ClientAsks, monkeypatch: pytest.MonkeyPatch) -> None:
    endpoint, payloads = STREAMS[name]
    reads = sse_reads(payloads)
    got = await _outcome(reads, endpoint, asks)
    with monkeypatch.context() as patched:
        patched.setattr(capture, "StreamAssembler", ReferenceAssembler)
        want = await _outcome(reads, endpoint, asks)
    assert got == want


@pytest.mark.parametrize("name", [n for n in STREAMS if not n.startswith("malformed")])
def test_feed_matches_reference(name: str) -> None:
    """Chunk by chunk: the assembled response, and the client's copy of each chunk, whatever the client asked."""
    endpoint, payloads = STREAMS[name]
    for asks in [None, *ALL_ASKS]:
        fast, reference = StreamAssembler(endpoint, asks), ReferenceAssembler(endpoint, asks)
        for payload in payloads:
            if payload == "[DONE]":
                continue
            try:
                chunk = orjson.loads(payload)
            except orjson.JSONDecodeError:
                continue
            if "error" in chunk and "choices" not in chunk:
                continue
            want = orjson.loads(payload)
            fast.feed(chunk)
            reference.feed(want)
            assert orjson.dumps(chunk) == orjson.dumps(want)
        assert fast.chunks == reference.chunks
        assert _assembled(fast) == _assembled(reference)


def _assembled(assembler: StreamAssembler | ReferenceAssembler) -> bytes | str:
    try:
        return orjson.dumps(assembler.response())
    except TypeError as exc:  # choice indexes that do not sort (null beside a number)
        return repr(exc)


def test_streams_cover_the_fast_path_and_its_exits() -> None:
    """The streams exercise what the fast path special-cases, so their passing means something."""
    deltas = []
    for _, payloads in STREAMS.values():
        for payload in payloads:
            try:
                event = json.loads(payload)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict) and isinstance(event.get("choices"), list):
                choices = [c for c in event["choices"] if isinstance(c, dict)]
                deltas += [c["delta"] for c in choices if isinstance(c.get("delta"), dict)]
    assert any(set(d) == {"content"} and d["content"] for d in deltas)  # the fast path
    assert any(set(d) == {"content"} and not d["content"] for d in deltas)
    assert any(d.get("content") and len(d) > 1 for d in deltas)  # content and something else
    assert any(d.get("content") is None and d.get("role") for d in deltas)
    assert any("tool_calls" in d for d in deltas) and any("reasoning_content" in d for d in deltas)
