"""What the gateway adds to upstream requests and takes back out of responses, and how a call becomes a record.

The gateway always asks vLLM for logprobs and token ids (training needs them), then strips them from what the
client receives unless the client asked for them itself, so the agent sees exactly what it would have seen
without us. Streams are assembled on the side into the equivalent non-stream response.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.store.models import CHAT

# Per-token arrays live in their own binary columns; the stored response JSON leaves them out.
_BULK_CHOICE_KEYS = ("token_ids", "logprobs", "prompt_logprobs", "prompt_token_ids")
_BULK_TOP_KEYS = ("prompt_token_ids", "prompt_logprobs")


@dataclass(slots=True)
class ClientAsks:
    """Which of the fields the gateway injects the client asked for itself (those pass through untouched)."""

    logprobs: bool
    token_ids: bool


@dataclass(slots=True)
class ChoiceCapture:
    index: int
    prompt_token_ids: list[int] | None
    completion_token_ids: list[int] | None
    logprobs: list[float] | None
    finish_reason: str | None


# The values vLLM's pydantic request models (lax mode) read as booleans, lower-cased strings compared as such.
_TRUE = frozenset(("1", "on", "t", "true", "y", "yes"))


def vllm_bool(value: Any) -> bool:
    """Whether vLLM reads a boolean field such as `stream` as true: it coerces "true", "yes", 1 and 1.0 too, and
    the gateway must agree (a body vLLM streams must be relayed as a stream)."""
    if value is True:
        return True
    if isinstance(value, str):
        return value.lower() in _TRUE
    return type(value) in (int, float) and value == 1


def prepare_upstream(
    body: dict[str, Any], endpoint: str, served_model: str, *, overrides: Mapping[str, Any] | None = None
) -> tuple[dict[str, Any], ClientAsks]:
    """The body vLLM receives: the client's, with `model` routed, `overrides` applied (the sampling values the
    gateway chose for the call: they win over the client's) and capture fields injected."""
    if endpoint == CHAT:
        asks_logprobs = vllm_bool(body.get("logprobs"))
    else:
        asks_logprobs = body.get("logprobs") is not None
    asks = ClientAsks(logprobs=asks_logprobs, token_ids=vllm_bool(body.get("return_token_ids")))
    upstream = dict(body)
    extra = upstream.get("trajgate_responses")
    if isinstance(extra, dict) and "owner" in extra:
        # The Responses API's record of who owns the answer (a key fingerprint) is for the gateway, not for vLLM.
        upstream["trajgate_responses"] = {k: v for k, v in extra.items() if k != "owner"}
    if overrides:
        upstream.update(overrides)
        if "max_tokens" in overrides and "max_completion_tokens" in upstream:
            # vLLM prefers max_completion_tokens when both are sent, which would undo the override.
            upstream["max_completion_tokens"] = overrides["max_tokens"]
    upstream["model"] = served_model
    if not asks.logprobs:
        upstream["logprobs"] = True if endpoint == CHAT else 0
    upstream["return_token_ids"] = True
    return upstream, asks


def strip_for_client(payload: dict[str, Any], asks: ClientAsks) -> None:
    """Remove (in place) what the gateway injected and the client didn't ask for; works on responses and chunks."""
    if asks.logprobs and asks.token_ids:
        return
    if not asks.token_ids and "prompt_token_ids" in payload:
        payload["prompt_token_ids"] = None
    for choice in payload.get("choices") or ():
        if not asks.token_ids:
            if "token_ids" in choice:
                choice["token_ids"] = None
            if "prompt_token_ids" in choice:  # completions put the prompt ids on each choice
                choice["prompt_token_ids"] = None
        if not asks.logprobs and "logprobs" in choice:
            choice["logprobs"] = None


def _choice_logprobs(choice: dict[str, Any], endpoint: str) -> list[float] | None:
    logprobs = choice.get("logprobs")
    if not logprobs:
        return None
    if endpoint == CHAT:
        content = logprobs.get("content")
        return None if content is None else [entry["logprob"] for entry in content]
    values = logprobs.get("token_logprobs")
    return None if values is None else list(values)


def choices_from_response(response: dict[str, Any], endpoint: str) -> list[ChoiceCapture]:
    """Per-choice ids and logprobs of a complete (non-stream or assembled) response.

    Chat responses carry the prompt ids once at the top level, completions on every choice.
    """
    shared_prompt = response.get("prompt_token_ids")
    return [
        ChoiceCapture(
            index=choice.get("index", position),
            prompt_token_ids=choice.get("prompt_token_ids") or shared_prompt,
            completion_token_ids=choice.get("token_ids"),
            logprobs=_choice_logprobs(choice, endpoint),
            finish_reason=choice.get("finish_reason"),
        )
        for position, choice in enumerate(response.get("choices") or ())
    ]


def check_trainable(
    prompt_ids: list[int] | None, completion_ids: list[int] | None, logprobs: list[float] | None
) -> tuple[bool, str | None]:
    """A call trains only with exact ids and one logprob per completion token; otherwise say why."""
    if not prompt_ids:
        return False, "missing prompt_token_ids"
    if not completion_ids:
        return False, "missing completion token_ids"
    if not logprobs:
        return False, "missing logprobs"
    if len(completion_ids) != len(logprobs):
        return False, f"{len(completion_ids)} token ids but {len(logprobs)} logprobs"
    return True, None


def slim_response(response: dict[str, Any]) -> dict[str, Any]:
    """The response as stored: everything but the per-token arrays, which have their own columns."""
    slim = {k: v for k, v in response.items() if k not in _BULK_TOP_KEYS}
    if "choices" in slim:
        slim["choices"] = [
            {k: v for k, v in choice.items() if k not in _BULK_CHOICE_KEYS} for choice in slim["choices"]
        ]
    return slim


@dataclass(slots=True)
class _ChoiceParts:
    role: str | None = None
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)
    logprob_entries: list[Any] = field(default_factory=list)
    has_logprobs: bool = False
    prompt_token_ids: list[int] | None = None
    finish_reason: str | None = None
    stop_reason: Any = None


class StreamAssembler:
    """Builds the equivalent non-stream response from stream chunks, as they pass through.

    Ids and logprobs are taken from every chunk, including those whose `delta` is empty (vLLM sends tool-call
    markup and the final EOS that way).

    `feed` runs for every SSE event the gateway relays, so it is written for the common chunk (one choice, a
    content delta, one logprob entry, one token id): keys usually absent are tested with `in` rather than fetched,
    and a delta holding only `content` skips the role, reasoning and tool-call lookups.

    Given `strip` (what the client asked), `feed` also does `strip_for_client(chunk, strip)` in the same pass over
    the choices, for a relay that sends each chunk on once it is read. The chunks must then be freshly parsed: a
    choice object listed twice would be read the second time already stripped.
    """

    def __init__(self, endpoint: str, strip: ClientAsks | None = None) -> None:
        self.endpoint = endpoint
        self.head: dict[str, Any] = {}
        self.prompt_token_ids: list[int] | None = None
        self.usage: dict[str, Any] | None = None
        self.chunks = 0
        self._choices: dict[int, _ChoiceParts] = {}
        self._chat = endpoint == CHAT
        self._logprobs_key = "content" if self._chat else "token_logprobs"
        self._strip_ids = strip is not None and not strip.token_ids
        self._strip_logprobs = strip is not None and not strip.logprobs

    def feed(self, chunk: dict[str, Any]) -> None:
        """Take one chunk into the assembly (and strip it for the client if the assembler was given `strip`)."""
        self.chunks += 1
        if not self.head:
            self.head = {"id": chunk.get("id"), "created": chunk.get("created"), "model": chunk.get("model")}
        # Fetched first: for a chunk that is not a JSON object this is the call that fails, as `.get` always did.
        choices = chunk.get("choices")
        strip_ids = self._strip_ids
        if "system_fingerprint" in chunk and chunk["system_fingerprint"] is not None:
            self.head["system_fingerprint"] = chunk["system_fingerprint"]
        if "prompt_token_ids" in chunk:
            if chunk["prompt_token_ids"] is not None:
                self.prompt_token_ids = chunk["prompt_token_ids"]
            if strip_ids:
                chunk["prompt_token_ids"] = None
        if "usage" in chunk and chunk["usage"] is not None:
            self.usage = chunk["usage"]
        for choice in choices or ():
            index = choice.get("index", 0)
            parts = self._choices.get(index)
            if parts is None:  # not setdefault, which built a throwaway _ChoiceParts for every chunk
                parts = self._choices[index] = _ChoiceParts()
            if "prompt_token_ids" in choice:  # completions only
                if choice["prompt_token_ids"] is not None:
                    parts.prompt_token_ids = choice["prompt_token_ids"]
                if strip_ids:
                    choice["prompt_token_ids"] = None
            token_ids = choice.get("token_ids")
            if token_ids is not None:
                if token_ids:
                    parts.token_ids.extend(token_ids)
                if strip_ids:
                    choice["token_ids"] = None
            logprobs = choice.get("logprobs")
            if logprobs is not None:
                if logprobs:
                    parts.has_logprobs = True
                    parts.logprob_entries.extend(logprobs.get(self._logprobs_key) or ())
                if self._strip_logprobs:
                    choice["logprobs"] = None
            if choice.get("finish_reason") is not None:
                parts.finish_reason = choice["finish_reason"]
            if "stop_reason" in choice and choice["stop_reason"] is not None:
                parts.stop_reason = choice["stop_reason"]
            if self._chat:
                delta = choice.get("delta")
                if delta:
                    content = delta.get("content")
                    if content:
                        parts.text.append(content)
                    if content is None or len(delta) > 1:  # anything besides content to read
                        self._feed_delta(parts, delta)
            elif choice.get("text"):
                parts.text.append(choice["text"])

    @staticmethod
    def _feed_delta(parts: _ChoiceParts, delta: dict[str, Any]) -> None:
        """The rest of a chat delta once its `content` is taken: role, reasoning, tool-call fragments."""
        if delta.get("role"):
            parts.role = delta["role"]
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if reasoning:
            parts.reasoning.append(reasoning)
        for call in delta.get("tool_calls") or ():
            slot = parts.tool_calls.setdefault(
                call.get("index", 0), {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            )
            if call.get("id"):
                slot["id"] = call["id"]
            if call.get("type"):
                slot["type"] = call["type"]
            function = call.get("function") or {}
            if function.get("name"):
                slot["function"]["name"] += function["name"]
            if function.get("arguments"):
                slot["function"]["arguments"] += function["arguments"]

    def response(self) -> dict[str, Any]:
        """The assembled response, shaped like vLLM's non-stream one (bulk arrays included)."""
        choices = []
        for index in sorted(self._choices):
            parts = self._choices[index]
            choice: dict[str, Any] = {"index": index}
            if self.endpoint == CHAT:
                message: dict[str, Any] = {"role": parts.role or "assistant", "content": "".join(parts.text) or None}
                if parts.reasoning:
                    message["reasoning"] = "".join(parts.reasoning)  # vLLM's name, which it reads back
                if parts.tool_calls:
                    message["tool_calls"] = [parts.tool_calls[i] for i in sorted(parts.tool_calls)]
                choice["message"] = message
                choice["logprobs"] = {"content": parts.logprob_entries} if parts.has_logprobs else None
            else:
                choice["text"] = "".join(parts.text)
                choice["prompt_token_ids"] = parts.prompt_token_ids
                choice["logprobs"] = {"token_logprobs": parts.logprob_entries} if parts.has_logprobs else None
            choice["finish_reason"] = parts.finish_reason
            choice["stop_reason"] = parts.stop_reason
            choice["token_ids"] = parts.token_ids or None
            choices.append(choice)
        kind = "chat.completion" if self.endpoint == CHAT else "text_completion"
        return {
            **self.head,
            "object": kind,
            "choices": choices,
            "usage": self.usage,
            "prompt_token_ids": self.prompt_token_ids,
        }
