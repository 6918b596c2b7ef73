"""The `token_in` run mode: a chat call continues its trajectory's exact token sequence instead of a re-rendering.

In `chat` mode vLLM renders every call's messages with the chat template, and templates do not reproduce what the
model generated (SmolLM2's drops the assistant's tool calls), so the model never sees its own actions and every turn
trains as a separate row. Here the gateway builds the prompt itself from vLLM's scale-out endpoints:

0. Know the template: a probe render fingerprints the template vLLM serves the model with; only one the
   qualification suite passed (or the operator vouches for) is served, with the model's end tokens from the
   registry (gateway/proxy/chat_templates.py), so every gateway decides alike before any generation ends.
1. Find the predecessor *by content*: every token_in record carries a `history_key`, a hash of the messages the call
   answered plus the assistant message it returned (one per choice), each as the template receives it. A new call
   hashes its message prefixes that end at an assistant message and takes the longest recorded one: this gateway's
   memory first, then the database. Content, not order or process, decides, so retries, concurrent calls and
   several gateways all stay correct.
2. Prompt = predecessor prompt ids + its completion ids + the bridge: the template's tokens after the matched
   assistant message in the render of the whole request (separator, new messages, generation prompt), located by
   the tail of that message's content in a render of the history up to it (`bridge_ids`); the template's closing
   token comes first if the completion did not end on one of the model's end tokens.
3. Generate from those ids (`/inference/v1/generate`), derender the ids into a normal ChatCompletion or chunk stream
   (`/v1/chat/completions/derender`, tool parser applied), and record the exact ids and logprobs.

A call with no usable predecessor starts a new segment from the full render and records why (`segment_reason`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from gateway.http import sse
from gateway.http.errors import GatewayError, UpstreamFailure
from gateway.http.metrics import GatewayMetrics
from gateway.proxy import capture, chat_templates
from gateway.proxy.asgi_io import relay_until_done
from gateway.proxy.chat_templates import TemplateInfo
from gateway.proxy.exchange import Exchange, Outcome
from gateway.store.lineage import common_prefix
from gateway.store.models import CHAT
from gateway.store.token_state import RecordedTurn, recorded_turns
from gateway.upstream.client import UpstreamError, UpstreamPool, UpstreamResponse
from gateway.upstream.failures import exchange_error, not_json, stream_error, upstream_error
from gateway.upstream.replicas import Lease, Replicas

if TYPE_CHECKING:
    from gateway.recorder.heartbeat import Peers

log = logging.getLogger("trajgate.token_in")

RENDER = "/v1/chat/completions/render"
# vLLM's SamplingParams.max_tokens default: what a render answer without max_tokens computed (vllm/sampling_params.py).
SAMPLING_DEFAULT_MAX_TOKENS = 16
GENERATE = "/inference/v1/generate"
DERENDER = "/v1/chat/completions/derender"

# Why a call started a new token segment (calls.segment_reason); null when it continued its predecessor.
FIRST_CALL = "first_call"
NO_MATCH = "no_recorded_history_matches"
# ... recorded as "template_unstable@<i>": where, in the full render, the template stopped lining up.
TEMPLATE_UNSTABLE = "template_unstable"
STATE_UNAVAILABLE = "state_unavailable"

_TEXT_PART = "text"
# How vLLM's chat path names a tool call (non-stream derender leaves the prefix off).
TOOL_CALL_ID_PREFIX = "chatcmpl-tool-"
# Most tokens a template puts after a message's end token before the next message (ChatML: one, "\n").
MAX_SEPARATOR = 4
# One database read of recorded turns may take this long before the call goes on without it.
STATE_READ_TIMEOUT_S = 5.0
# Longest pause between two reads while waiting for another gateway's record.
_POLL_S = 0.1
# Message prefixes looked up per call, newest first: a predecessor further back would leave a long bridge anyway.
MAX_CANDIDATES = 64
# Served model names whose template is remembered (every trained step adds an adapter name).
MAX_MODELS = 4096


def normalise_message(message: Any) -> Any:
    """The message as the chat template receives it, so the history key changes only when the render can.

    This mirrors what vLLM hands the template (`vllm/renderers/chat_utils.py`: `_parse_chat_message_content` and
    `_postprocess_messages`): the role, the content (null, absent, "" and [] alike; a string equals one text part),
    `name`, an assistant's tool calls (id, function name, arguments parsed as JSON: re-serialised arguments and key
    order match; arguments that are not JSON count as {}, see _normalise_tool_call), a tool message's
    `tool_call_id`, and a developer message's `tools`. Nothing else a client adds or
    echoes back (`provider_specific_fields`, `refusal`, `annotations`, `audio`, nulls...) reaches the template, so
    nothing else counts. An assistant's reasoning (`reasoning`, or the older `reasoning_content`) is left out too:
    the turn it belongs to continues from the exact ids the gateway recorded, which hold the model's reasoning
    whether or not the client sends it back."""
    if not isinstance(message, dict):
        return message
    role = message.get("role")
    out: dict[str, Any] = {"role": role}
    content = _normalise_content(message.get("content"))
    if content is not None:
        out["content"] = content
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    if isinstance(message.get("task"), str):
        out["task"] = message["task"]
    if role == "assistant":
        calls = message.get("tool_calls")
        if isinstance(calls, list) and calls:
            out["tool_calls"] = [_normalise_tool_call(call) for call in calls]
    elif role == "tool" and message.get("tool_call_id") is not None:
        out["tool_call_id"] = message["tool_call_id"]
    elif role == "developer" and message.get("tools") is not None:
        out["tools"] = _without_nulls(message["tools"])
    return out


def _normalise_content(content: Any) -> Any:
    """None for no content; a string for one text part; a list of texts for several (vLLM joins them with a
    newline or hands them over as parts: either way not the same as their concatenation); other parts as sent,
    nulls left out."""
    if content is None or content == "" or content == []:
        return None
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == _TEXT_PART and isinstance(part.get(_TEXT_PART), str)
        for part in content
    ):
        texts = [part[_TEXT_PART] for part in content]
        return texts[0] if len(texts) == 1 else texts
    return _without_nulls(content)


def _without_nulls(value: Any) -> Any:
    """`value` with null-valued keys left out at every depth (a dict of nulls becomes {})."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _normalise_tool_call(call: Any) -> Any:
    if not isinstance(call, dict):
        return call
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            # Arguments that are not JSON (a call cut by max_tokens) reach a Messages client as `input: {}`, which it
            # echoes back as "{}"; the call's id still names the recorded turn, so both forms key alike.
            arguments = {}
    return {"id": call.get("id"), "function": {"name": function.get("name"), "arguments": arguments}}


def extend_key(key: str, message: Any) -> str:
    """The history key of a history whose key is `key`, with `message` appended (the empty history's key is "")."""
    canonical = orjson.dumps(normalise_message(message), option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    return hashlib.sha256(key.encode() + b"\0" + canonical).hexdigest()


def history_keys(messages: Sequence[Any]) -> list[str]:
    """keys[i] is the history key of messages[: i + 1]."""
    keys: list[str] = []
    key = ""
    for message in messages:
        key = extend_key(key, message)
        keys.append(key)
    return keys


@dataclass(frozen=True, slots=True)
class Bridge:
    """The ids that follow a predecessor's completion, or why there are none and where (a token index of the full
    render) the template stopped lining up."""

    ids: list[int] | None
    position: int = 0


def bridge_ids(
    prefix: list[int], full: list[int], completion: list[int], end_tokens: frozenset[int], turn_ends: frozenset[int]
) -> Bridge:
    """The template's tokens after the matched assistant message, taken from the full render itself.

    `prefix` renders the history up to that assistant message (no generation prompt), `full` the whole request
    (with one). Templates need not render the assistant message alike in both (Qwen3 drops the `<think>` block of
    an assistant message once a user message follows it, or in non-thinking mode; harmony closes a final answer
    with `<|end|>` in a history and `<|return|>` at its end), so the two are not compared as prefix and whole.
    Instead the tail of the assistant message's content in `prefix` (everything before its closing token) is found
    in `full` after the point where the two renders part: the token after it must be a turn-end token, and what
    follows is the separator, the new messages and the generation prompt. A completion that ended on one of the
    model's end tokens keeps its own (`<|eom_id|>`, `<|return|>`); one cut short gets the template's closing token.
    """
    closing = _last_turn_end(prefix, turn_ends)
    if closing is None:
        return Bridge(None, common_prefix(prefix, full))
    content = prefix[:closing]
    start = common_prefix(content, full)
    at = start if start == len(content) else _find_tail(content, full, start)
    if at is None or at >= len(full) or full[at] not in turn_ends:
        return Bridge(None, start if at is None else at)
    ended = bool(completion) and completion[-1] in end_tokens
    return Bridge(full[at + 1 :] if ended else full[at:])


def _last_turn_end(ids: list[int], turn_ends: frozenset[int]) -> int | None:
    """The index of the token that closes the last message of a render without a generation prompt: the last
    turn-end token, followed by at most the template's short separator."""
    for index in range(len(ids) - 1, max(len(ids) - 2 - MAX_SEPARATOR, -1), -1):
        if ids[index] in turn_ends:
            return index
    return None


def _as_text(ids: list[int]) -> str:
    """Token ids as one code point each, so a search for a run of ids is a (C-speed) substring search."""
    return "".join(map(chr, ids))


def _find_tail(content: list[int], full: list[int], start: int) -> int | None:
    """Where the longest tail of `content` (past `start`, where the renders part) ends in `full` after `start`:
    the index just after it, or None if not even its last token is there."""
    haystack = _as_text(full)
    needle = _as_text(content)
    for cut in range(start, len(content)):
        found = haystack.find(needle[cut:], start)
        if found >= 0:
            return found + len(content) - cut
    return None


@dataclass(frozen=True, slots=True)
class TurnState:
    """What a recorded choice leaves for the turn that continues it."""

    seq: int
    choice_index: int
    prompt_ids: list[int]
    completion_ids: list[int]


class TokenStates:
    """This gateway's recent token states by (trajectory, history key), so a trajectory's next call usually needs no
    database read. Bounded by the token ids held; the least recently used go first."""

    def __init__(self, max_tokens: int = 8_000_000) -> None:
        self._max_tokens = max_tokens
        self._tokens = 0
        self._states: OrderedDict[tuple[str, str], TurnState] = OrderedDict()
        self._trajectories: OrderedDict[str, None] = OrderedDict()

    def get(self, trajectory_id: str, key: str) -> TurnState | None:
        state = self._states.get((trajectory_id, key))
        if state is not None:
            self._states.move_to_end((trajectory_id, key))
        return state

    def knows(self, trajectory_id: str) -> bool:
        return trajectory_id in self._trajectories

    def put(self, trajectory_id: str, key: str, state: TurnState) -> None:
        old = self._states.pop((trajectory_id, key), None)
        if old is not None:
            self._tokens -= _size(old)
        self._states[(trajectory_id, key)] = state
        self._tokens += _size(state)
        self._trajectories[trajectory_id] = None
        self._trajectories.move_to_end(trajectory_id)
        while self._tokens > self._max_tokens and self._states:
            _, evicted = self._states.popitem(last=False)
            self._tokens -= _size(evicted)
        while len(self._trajectories) > 100_000:
            self._trajectories.popitem(last=False)


def _size(state: TurnState) -> int:
    return len(state.prompt_ids) + len(state.completion_ids)


@dataclass(slots=True)
class Plan:
    """The prompt a call is generated from, and why it starts a new segment (None: it continues `predecessor`, the
    recorded (seq, choice) whose prompt + completion ids the prompt starts with)."""

    prompt: list[int]
    sampling_params: dict[str, Any]
    segment_reason: str | None
    predecessor: tuple[int, int] | None = None


class TokenIn:
    """Serves the chat calls of token_in runs for the proxy (which hands over a call once it is attributed).

    Built with what it uses rather than the proxy itself: the upstream pool and replicas it sends render, generate
    and derender to, and the proxy as an `Outcome`, which records and answers each call as chat mode does."""

    def __init__(
        self,
        upstream: UpstreamPool,
        replicas: Replicas,
        outcome: Outcome,
        metrics: GatewayMetrics,
        engine: Engine | None,
        wait_s: float,
        templates_file: str | None = None,
    ) -> None:
        self.upstream = upstream
        self.replicas = replicas
        self.outcome = outcome
        self.metrics = metrics
        self.engine = engine
        self.wait_s = wait_s
        self.states = TokenStates()
        self.registry = chat_templates.load_registry(templates_file)
        # Per served model name: its template's entry, or the fingerprint of a template not qualified.
        self._templates: dict[str, TemplateInfo | str] = {}
        # Several gateways on one Postgres (set by the app): a call waits for the others' writers before it decides
        # that its history was never answered.
        self.peers: Peers | None = None

    async def template(self, model: str, lease: Lease | None) -> TemplateInfo:
        """The qualified template vLLM serves `model` with (one probe render per model and process, the same answer
        on every gateway); raises UpstreamFailure naming the fingerprint for one not qualified."""
        known = self._templates.get(model)
        if known is None:
            renders = await asyncio.gather(*(self._probe(body, lease) for body in chat_templates.probe_bodies(model)))
            key = chat_templates.fingerprint(list(renders))
            known = self.registry.get(key, key)
            if len(self._templates) >= MAX_MODELS:
                self._templates.clear()
            self._templates[model] = known
        if isinstance(known, str):
            message = (
                f"token_mode token_in is not qualified for the chat template vLLM serves {model!r} with (fingerprint "
                f"{known}): its turns might not continue exactly. Qualify it (scripts/qualify_token_in.py) or vouch "
                "for it with an entry in TRAJGATE_TOKEN_IN_TEMPLATES, or use token_mode chat"
            )
            raise UpstreamFailure(GatewayError(400, message, "invalid_request_error", "template_not_qualified"))
        return known

    # -- finding the predecessor ---------------------------------------------------------------------------------

    async def predecessor(
        self, trajectory_id: str, messages: Sequence[Any], keys: list[str]
    ) -> tuple[TurnState | None, int, str | None]:
        """The longest recorded history prefix ending at an assistant message: (state, prefix length, reason if none).

        Memory first; then the database, polled for up to `wait_s` while the newest assistant message is not found
        and the trajectory has token_in turns recorded (its record may be on its way from another gateway)."""
        candidates = [i + 1 for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"]
        candidates = candidates[::-1][:MAX_CANDIDATES]
        if not candidates:
            return None, 0, FIRST_CALL
        best: tuple[TurnState, int] | None = None
        for length in candidates:
            state = self.states.get(trajectory_id, keys[length - 1])
            if state is not None:
                best = (state, length)
                break
        if best is not None and best[1] == candidates[0]:
            return best[0], best[1], None
        known = self.states.knows(trajectory_id)
        deadline = time.monotonic() + self.wait_s
        peers_waited = False
        while True:
            wanted = [length for length in candidates if best is None or length > best[1]]
            try:
                found, recorded = await self._read(trajectory_id, [keys[length - 1] for length in wanted])
            except (TimeoutError, SQLAlchemyError) as exc:
                log.warning("token state read failed: %s", type(exc).__name__)
                if best is not None:
                    return best[0], best[1], None
                return None, 0, STATE_UNAVAILABLE
            for length in wanted:
                turn = found.get(keys[length - 1])
                if turn is not None:
                    best = (TurnState(**turn._asdict()), length)
                    break
            if best is not None and best[1] == candidates[0]:
                break
            if time.monotonic() >= deadline:
                break
            if not (known or recorded):
                # Nothing says this trajectory was answered before, but another gateway may have answered its last
                # turn a moment ago with the record still in its writer: once every live gateway has written what
                # it answered before now, one more read decides (a first call costs that one wait, no poll).
                if peers_waited or self.peers is None or not await self.peers.others_written(self.wait_s):
                    break
                peers_waited = True
                continue
            await asyncio.sleep(min(_POLL_S, max(deadline - time.monotonic(), 0)))
        if best is None:
            return None, 0, NO_MATCH if (known or recorded) else FIRST_CALL
        return best[0], best[1], None

    async def _read(self, trajectory_id: str, keys: list[str]) -> tuple[dict[str, RecordedTurn], bool]:
        if self.engine is None:
            return {}, False
        return await asyncio.wait_for(
            asyncio.to_thread(recorded_turns, self.engine, trajectory_id, keys), STATE_READ_TIMEOUT_S
        )

    # -- building the prompt -------------------------------------------------------------------------------------

    async def plan(self, call: Exchange, render_body: dict[str, Any], keys: list[str]) -> Plan:
        messages = render_body.get("messages")
        if not isinstance(messages, list):
            full = await self._post(RENDER, render_body, call.lease)  # vLLM explains what is wrong with the body
            return Plan(full["token_ids"], full["sampling_params"], FIRST_CALL)
        template = await self.template(render_body["model"], call.lease)
        state, length, reason = await self.predecessor(call.attribution.trajectory_id, messages, keys)
        if state is None:
            full = await self._post(RENDER, render_body, call.lease)
            return Plan(full["token_ids"], full["sampling_params"], reason)
        prefix_body = {**render_body, "messages": messages[:length], "add_generation_prompt": False}
        full, prefix = await asyncio.gather(
            self._post(RENDER, render_body, call.lease), self._post(RENDER, prefix_body, call.lease)
        )
        bridge = bridge_ids(
            prefix["token_ids"], full["token_ids"], state.completion_ids, template.end_token_ids, template.turn_end_ids
        )
        if bridge.ids is None:
            return Plan(full["token_ids"], full["sampling_params"], f"{TEMPLATE_UNSTABLE}@{bridge.position}")
        prompt = state.prompt_ids + state.completion_ids + bridge.ids
        return Plan(prompt, full["sampling_params"], None, (state.seq, state.choice_index))

    async def _probe(self, body: dict[str, Any], lease: Lease | None) -> list[int] | None:
        """One probe's ids, or None where the template refuses it (vLLM's 400); other failures propagate."""
        try:
            return list((await self._post(RENDER, body, lease)).get("token_ids") or ())
        except UpstreamFailure as failure:
            if failure.error.status == 400:
                return None
            raise

    # -- upstream ------------------------------------------------------------------------------------------------

    async def render(self, body: dict[str, Any]) -> list[int]:
        """The exact prompt ids vLLM renders for a chat request (Anthropic's count_tokens asks this too); raises
        UpstreamFailure with what the client should be told when vLLM cannot."""
        lease = self.replicas.lease(None, body.get("model"))
        try:
            return list((await self._post(RENDER, body, lease))["token_ids"])
        finally:
            lease.release()

    async def _post(self, path: str, body: dict[str, Any], lease: Lease | None) -> dict[str, Any]:
        """One scale-out step on the call's replica (all of a call's steps go to the replica it was leased)."""
        assert lease is not None
        try:
            response = await lease.post(self.upstream, path, orjson.dumps(body), root=True)
            try:
                raw = await response.read()
                status = response.status
            finally:
                response.release()
            lease.answered(status)
        except (TimeoutError, UpstreamError) as exc:
            raise UpstreamFailure(exchange_error(exc, path)) from None
        if status != 200:
            raise UpstreamFailure(upstream_error(path, status, raw))
        try:
            answer = orjson.loads(raw)
        except orjson.JSONDecodeError:
            answer = None
        if not isinstance(answer, dict):
            raise UpstreamFailure(not_json(path))
        return answer

    # -- the call ------------------------------------------------------------------------------------------------

    async def handle(self, call: Exchange, upstream_body: dict[str, Any]) -> None:
        """Plan, generate, derender and answer one chat call; every failure is recorded and answered OpenAI-style."""
        messages = upstream_body.get("messages")
        keys = history_keys(messages) if isinstance(messages, list) else []
        render_body = {k: v for k, v in upstream_body.items() if k not in ("stream", "stream_options")}
        chat_request = dict(upstream_body)
        if not call.asks.logprobs:
            chat_request.pop("logprobs", None)
        if not call.asks.token_ids:
            chat_request.pop("return_token_ids", None)
        call.upstream_started = time.perf_counter()
        try:
            plan = await self.plan(call, render_body, keys)
            call.segment_reason = plan.segment_reason
            call.predecessor = plan.predecessor
            sampling_params = {
                # Render leaves out the fields at SamplingParams' defaults, max_tokens 16 among them, and generate
                # reads a missing max_tokens as "not asked": the rest of the context. Absent, it was 16.
                "max_tokens": SAMPLING_DEFAULT_MAX_TOKENS,
                **plan.sampling_params,
                "logprobs": plan.sampling_params.get("logprobs") or 0,
            }
            model = upstream_body["model"]
            generate_body = {"model": model, "token_ids": plan.prompt, "sampling_params": sampling_params}
            if call.stream:
                await self._stream(call, generate_body, chat_request, keys)
                return
            generated = await self._post(GENERATE, generate_body, call.lease)
            shown = for_derender(generated, whole=True)
            derendered = await self._post(
                DERENDER, {"model": model, "chat_request": chat_request, "generate_response": shown}, call.lease
            )
        except UpstreamFailure as failure:
            await self.outcome.fail(call, failure.error)
            return
        call.first_chunk = call.finished = time.perf_counter()
        call.status = 200
        response = self._answer(call, plan.prompt, generated, derendered, chat_request)
        self._record(call, plan.prompt, generated.get("choices") or [], response, keys)
        capture.strip_for_client(response, call.asks)
        await self.outcome.send_answer(call, response)

    def _answer(
        self,
        call: Exchange,
        prompt: list[int],
        generated: dict[str, Any],
        derendered: dict[str, Any],
        chat_request: dict[str, Any],
    ) -> dict[str, Any]:
        """The ChatCompletion as chat mode would have sent it: gateway-assigned id, real usage, ids on the side."""
        response = derendered
        response["id"] = "chatcmpl-" + call.request_id.removeprefix("req-")
        response["prompt_token_ids"] = prompt
        by_index = {choice.get("index", 0): choice for choice in generated.get("choices") or ()}
        completion_tokens = 0
        for choice in response.get("choices") or ():
            if choice.get("logprobs") is not None:
                choice["logprobs"] = {"content": chat_logprobs(choice["logprobs"], chat_request)}
            source = by_index.get(choice.get("index", 0), {})
            ids = source.get("token_ids") or []
            choice["token_ids"] = ids
            completion_tokens += len(ids)
            if ended_at_once(source) and isinstance(choice.get("message"), dict):
                # Derender read the end token's text (`for_derender(whole=True)`); the chat path read none.
                message = choice["message"]
                for field in ("content", "reasoning", "reasoning_content"):
                    if isinstance(message.get(field), str):
                        message[field] = ""
            # vLLM's chat path reports a tool call this way; non-stream derender says "stop" (streaming agrees).
            if choice.get("finish_reason") == "stop" and (choice.get("message") or {}).get("tool_calls"):
                choice["finish_reason"] = "tool_calls"
            for tool_call in (choice.get("message") or {}).get("tool_calls") or ():
                # Non-stream derender names a call by bare hex; vLLM's chat path as chatcmpl-tool-<hex>.
                if isinstance(tool_call.get("id"), str) and not tool_call["id"].startswith(TOOL_CALL_ID_PREFIX):
                    tool_call["id"] = TOOL_CALL_ID_PREFIX + tool_call["id"]
        response["usage"] = usage(len(prompt), completion_tokens)
        return response

    def _record(
        self,
        call: Exchange,
        prompt: list[int],
        generated_choices: Sequence[dict[str, Any]],
        response: dict[str, Any] | None,
        keys: list[str],
    ) -> None:
        """One record per choice with the exact ids and logprobs from generate; remember each choice's state under
        its history key so this trajectory's next call finds it without the database."""
        messages_key = keys[-1] if keys else ""
        answered = {c.get("index", 0): c for c in (response or {}).get("choices") or ()}
        captured: list[capture.ChoiceCapture] = []
        for generated in generated_choices:
            index = generated.get("index", 0)
            ids = generated.get("token_ids") or None
            entries = (generated.get("logprobs") or {}).get("content")
            logprobs = None if entries is None else [entry["logprob"] for entry in entries]
            answer = answered.get(index, {})
            finish_reason = answer.get("finish_reason") or generated.get("finish_reason")
            captured.append(capture.ChoiceCapture(index, prompt, ids, logprobs, finish_reason))
            message = answer.get("message")
            if message is not None and ids:
                key = extend_key(messages_key, message)
                call.history_keys[index] = key
                self.states.put(call.attribution.trajectory_id, key, TurnState(call.seq, index, prompt, ids))
        call.captured = captured
        self.outcome.submit(call, response)

    # -- streaming -----------------------------------------------------------------------------------------------

    async def _stream(
        self, call: Exchange, generate_body: dict[str, Any], chat_request: dict[str, Any], keys: list[str]
    ) -> None:
        """Generate as a stream and derender it chunk by chunk, each derender carrying the previous `stream_state`.

        Generate chunks that arrive while a derender is in flight are coalesced into the next derender, so the HTTP
        round-trips stay bounded by what the client can be sent, not by the number of tokens. The record is written
        whatever happens to the client (the OpenAI SDK hangs up on `[DONE]`)."""
        assert call.lease is not None
        prompt = generate_body["token_ids"]
        try:
            payload = orjson.dumps({**generate_body, "stream": True})
            upstream = await call.lease.post(self.upstream, GENERATE, payload, root=True)
        except (TimeoutError, UpstreamError) as exc:
            await self.outcome.fail(call, exchange_error(exc, GENERATE))
            return
        call.lease.answered(upstream.status)
        try:
            if upstream.status != 200:
                try:
                    error = upstream_error(GENERATE, upstream.status, await upstream.read())
                except (TimeoutError, UpstreamError) as exc:
                    error = exchange_error(exc, GENERATE)
                await self.outcome.fail(call, error)
                return
            relay = StreamRelay(self, call, upstream, chat_request, prompt, keys)
            await call.answer.start(call.headers)
            call.status = 200
            try:
                ended_early = await relay_until_done(
                    relay.run(), call.receive, call.answer.broke, lambda: relay.done, relay.fail
                )
                if ended_early is not None:
                    call.error = ended_early
            finally:
                if not relay.done:
                    upstream.close()  # drop the connection so vLLM sees the hang-up and stops generating
                relay.record()
                self.metrics.count_request(call.endpoint, 200)
            with contextlib.suppress(OSError):
                await call.answer.end()
        finally:
            upstream.release()


class StreamRelay:
    """One streamed token_in call: reads generate's SSE, derenders coalesced chunks, sends client chunks."""

    def __init__(
        self,
        owner: TokenIn,
        call: Exchange,
        upstream: UpstreamResponse,
        chat_request: dict[str, Any],
        prompt: list[int],
        keys: list[str],
    ) -> None:
        self.owner = owner
        self.keys = keys
        self.call = call
        self.upstream = upstream
        self.chat_request = {**chat_request, "stream": True}
        self.asks = call.asks
        self.prompt = prompt
        self.answer = call.answer
        self.pending: list[dict[str, Any]] = []
        self.arrived = asyncio.Event()
        self.reading = True
        self.done = False
        self.recorded = False
        self.assembler = capture.StreamAssembler(CHAT)
        self.generated: dict[int, dict[str, Any]] = {}  # per choice: ids, logprobs, finish/stop reason
        self.states: dict[int, Any] = {}
        self.logprobs: dict[int, list[dict[str, Any]]] = {}  # per choice: entries not yet sent (no chunk came back)
        self.prompt_sent = False
        self.derenders = 0
        self.head: dict[str, Any] = {}

    async def run(self) -> None:
        reader = asyncio.ensure_future(self._read())
        try:
            while True:
                await self.arrived.wait()
                self.arrived.clear()
                batch, self.pending = self.pending, []
                if batch:
                    await self._derender(batch)
                if not self.reading and not self.pending:
                    break
            await reader  # surfaces a read error
        finally:
            reader.cancel()
        if self.head and (self.chat_request.get("stream_options") or {}).get("include_usage"):
            tokens = sum(len(g["token_ids"]) for g in self.generated.values())
            usage_chunk = {**self.head, "choices": [], "usage": usage(len(self.prompt), tokens)}
            self.assembler.feed(usage_chunk)
            await self._send_chunk(usage_chunk)
        self.done = True
        self.call.finished = time.perf_counter()
        self.record()  # before the client sees [DONE]: it may hang up, and a flush must find the record
        self.answer.done()
        await self.answer.flush()

    async def _read(self) -> None:
        lines = sse.DataLines()
        try:
            async for data in self.upstream.iter_chunks():
                self._take(lines.feed(data))
            last = lines.end()
            if last is not None:
                self._take((last,))
        finally:
            self.reading = False
            self.arrived.set()

    def _take(self, payloads: Sequence[bytes]) -> None:
        for payload in payloads:
            if payload == sse.DONE_PAYLOAD:
                continue
            chunk = orjson.loads(payload)
            if "error" in chunk and "choices" not in chunk:
                raise UpstreamFailure(stream_error(chunk["error"]))
            self.pending.append(chunk)
        if self.pending:
            self.arrived.set()

    async def _derender(self, batch: list[dict[str, Any]]) -> None:
        for index, merged in merge_generate_chunks(batch).items():
            choice = merged["choices"][0]
            slot = self.generated.setdefault(index, {"token_ids": [], "logprobs": [], "finish_reason": None})
            slot["token_ids"].extend(choice.get("token_ids") or ())
            slot["logprobs"].extend(e["logprob"] for e in (choice.get("logprobs") or {}).get("content") or ())
            if choice.get("finish_reason") is not None:
                slot["finish_reason"] = choice["finish_reason"]
                slot["stop_reason"] = choice.get("stop_reason")
            shown = for_derender(merged)
            body = {
                "model": self.chat_request["model"],
                "chat_request": self.chat_request,
                "stream": True,
                "generate_chunk": shown,
                "stream_state": self.states.get(index),
                "prompt_token_ids": self.prompt,
            }
            if self.asks.logprobs:
                answer, entries = await asyncio.gather(
                    self.owner._post(DERENDER, body, self.call.lease), self._logprobs(merged)
                )
                self.logprobs.setdefault(index, []).extend(entries)
            else:
                answer = await self.owner._post(DERENDER, body, self.call.lease)
            self.derenders += 1
            self.states[index] = answer.get("stream_state")
            chunk = answer.get("chunk")
            if not isinstance(chunk, dict):
                continue
            if self.asks.logprobs:
                for out in chunk.get("choices") or ():
                    out["logprobs"] = {"content": self.logprobs.pop(index, [])}
            if self.call.first_chunk is None:
                self.call.first_chunk = time.perf_counter()
            chunk["id"] = "chatcmpl-" + self.call.request_id.removeprefix("req-")
            self.head = {k: chunk.get(k) for k in ("id", "object", "created", "model")}
            for out in chunk.get("choices") or ():
                out["token_ids"] = choice.get("token_ids")
                # vLLM's chat path opens every stream with the role and an empty content; derender sends the role
                # with the first text, or with none when the first token ended the turn, where the SDKs would then
                # assemble a message whose content is None instead of chat mode's "".
                delta = out.get("delta")
                if isinstance(delta, dict) and "role" in delta and delta.get("content") is None:
                    delta["content"] = ""
                # Streaming derender says `tool_calls` once a call was streamed, whatever ended the generation; vLLM's
                # chat path only when it stopped, so a call cut by max_tokens ends with `length` there.
                if out.get("finish_reason") == "tool_calls" and choice.get("finish_reason") not in (None, "stop"):
                    out["finish_reason"] = choice["finish_reason"]
            if not self.prompt_sent:
                chunk["prompt_token_ids"] = self.prompt
                self.prompt_sent = True
            self.assembler.feed(chunk)
            if _says_something(chunk) or self.asks.token_ids or self.asks.logprobs:
                await self._send_chunk(chunk)

    async def _logprobs(self, merged: dict[str, Any]) -> list[dict[str, Any]]:
        """The chat-shaped logprob entries of a coalesced generate chunk. vLLM's streaming derender returns none, the
        non-stream one returns exactly what the chat path streams (token strings, bytes, top_logprobs), so the chunk's
        ids go through it too, only when the client asked. The end token stays in: only its entry is used, and a last
        chunk holding just that token would otherwise be refused for having no ids."""
        chat_request = {k: v for k, v in self.chat_request.items() if k not in ("stream", "stream_options")}
        body = {"model": chat_request["model"], "chat_request": chat_request, "generate_response": merged}
        answer = await self.owner._post(DERENDER, body, self.call.lease)
        self.derenders += 1
        choices = answer.get("choices") or [{}]
        return chat_logprobs(choices[0].get("logprobs"), self.chat_request)

    async def _send_chunk(self, chunk: dict[str, Any]) -> None:
        capture.strip_for_client(chunk, self.asks)
        self.answer.chunk(chunk)
        await self.answer.flush()

    def fail(self, error: str) -> None:
        """The stream broke: record why, before the client is told."""
        self.call.error = error
        self.record()

    def record(self) -> None:
        """Submit the call once, complete or partial."""
        if self.recorded:
            return
        self.recorded = True
        call = self.call
        if not call.finished:
            call.finished = time.perf_counter()
        if not self.done and call.error is None:
            call.error = "stream ended before vLLM finished"
        response = self.assembler.response() if self.assembler.chunks else None
        if response is not None:
            response["prompt_token_ids"] = self.prompt
            for choice in response["choices"]:
                choice["token_ids"] = self.generated.get(choice["index"], {}).get("token_ids") or None
        generated = [
            {
                "index": index,
                "token_ids": slot["token_ids"],
                "logprobs": {"content": [{"logprob": value} for value in slot["logprobs"]]},
                "finish_reason": slot["finish_reason"],
                "stop_reason": slot.get("stop_reason"),
            }
            for index, slot in sorted(self.generated.items())
        ]
        if call.error is not None:
            call.captured = [
                capture.ChoiceCapture(g["index"], self.prompt, g["token_ids"] or None, None, g["finish_reason"])
                for g in generated
            ] or None
            self.owner.outcome.submit(call, response)
            return
        self.owner._record(call, self.prompt, generated, response, self.keys)


def merge_generate_chunks(chunks: Sequence[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Generate stream chunks that piled up, as one chunk per choice: ids and logprob entries concatenated, the last
    finish and stop reasons kept. One derender request per choice then covers them all."""
    merged: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk.get("choices") or ():
            index = choice.get("index", 0)
            if index not in merged:
                merged[index] = {**chunk, "choices": [copy.deepcopy(choice)]}
                continue
            target = merged[index]["choices"][0]
            target["token_ids"] = (target.get("token_ids") or []) + (choice.get("token_ids") or [])
            if choice.get("logprobs") is not None:
                entries = (target.get("logprobs") or {}).get("content") or []
                target["logprobs"] = {"content": entries + (choice["logprobs"].get("content") or [])}
            for key in ("finish_reason", "stop_reason"):
                if choice.get(key) is not None:
                    target[key] = choice[key]
            for key, value in chunk.items():
                if key != "choices" and value is not None:
                    merged[index][key] = value
    return merged


def for_derender(generated: dict[str, Any], whole: bool = False) -> dict[str, Any]:
    """The generate response (or chunk) as derender should see it: without the end-of-turn token a choice stopped on.

    vLLM's own chat path leaves that token's text out of the answer; derender would put it into the content
    (`...Celsius.<|im_end|>` when a tool parser keeps special tokens). The logprobs keep their entry for it, as the
    chat path's do. A stop string (stop_reason text) was not generated as a token, so nothing is taken then.

    A `whole` answer (the non-stream derender) keeps the token when it is a choice's only one: vLLM refuses a choice
    without ids there, and a model may end its turn at once. `TokenIn._answer` then empties the text derender made
    of that token (the chat path has none to parse), and derender still gives the token's logprob entry. A choice
    generate sent without any id is vLLM breaking its own contract: a 502 naming it, not derender's 400 that would
    blame the client."""
    out = {**generated, "choices": []}
    for choice in generated.get("choices") or ():
        ids = choice.get("token_ids") or []
        if whole and not ids:
            message = f"vLLM's generate answered choice {choice.get('index', 0)} without token ids"
            raise UpstreamFailure(GatewayError(502, message, "upstream_error"))
        if _ends_on_token(choice) and len(ids) > (1 if whole else 0):
            choice = {**choice, "token_ids": ids[:-1]}
        out["choices"].append(choice)
    return out


def _ends_on_token(choice: dict[str, Any]) -> bool:
    """The choice stopped on an end token (the last of its ids), not on a stop string or a length."""
    return choice.get("finish_reason") == "stop" and not isinstance(choice.get("stop_reason"), str)


def ended_at_once(choice: dict[str, Any]) -> bool:
    """The model's first token ended its turn: the whole answer is that end token, and its text is empty."""
    return _ends_on_token(choice) and len(choice.get("token_ids") or ()) == 1


def chat_logprobs(derendered: dict[str, Any] | None, chat_request: dict[str, Any]) -> list[dict[str, Any]]:
    """Derender's logprob entries as vLLM's chat path writes them. Generate always lists the sampled token among its
    top logprobs (it is asked for `logprobs: 0`), and derender passes that on; chat mode without `top_logprobs`
    answers `top_logprobs: []`."""
    entries = list((derendered or {}).get("content") or ())
    if not chat_request.get("top_logprobs"):
        entries = [{**entry, "top_logprobs": []} for entry in entries]
    return entries


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The `usage` block of a chat answer built from generate's ids, as vLLM's chat path writes it."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }


def _says_something(chunk: dict[str, Any]) -> bool:
    """Whether a derendered chunk carries anything for the client (derender answers every token, most with an empty
    delta while the tool parser holds markup back)."""
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if choice.get("finish_reason") is not None or any(delta.get(k) for k in ("role", "content", "tool_calls")):
            return True
        if delta.get("reasoning") or delta.get("reasoning_content"):
            return True
    return False
