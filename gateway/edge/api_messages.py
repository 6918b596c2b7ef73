"""The Anthropic Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), translated at the edge.

vLLM's own /v1/messages returns no token ids or logprobs, and it converts the request into a chat request inside
anyway, so the gateway does that conversion here (mirroring vLLM's, so the model sees the same prompt) and runs the
call through the ordinary chat path: attribution, retries, sampling, token_in, the record and the trainer all treat
it as the chat call it is. The record holds the chat request the model saw and vLLM's chat answer, labelled
`messages`. Only the edges are Anthropic: the body is validated here into Anthropic-shaped 400s, the chat request goes
into the proxy's one path as a dict (`Proxy.serve`), and the chat path's answer, handed over as dicts (a chat
completion, an error, or each chunk of a stream), is rewritten into a Message, an Anthropic error, or Anthropic's
stream events (`AnthropicAnswer`).

Extended thinking: `thinking` is passed on the way vLLM's endpoint does (`enabled` sets a thinking token budget,
`disabled` asks the template for reasoning effort "none", `adaptive` pins nothing); whatever reasoning vLLM's
reasoning parser returns comes back as `thinking` blocks. A model without a reasoning parser simply returns none.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal, get_args

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from starlette.types import Receive, Scope, Send

from gateway.http import sse
from gateway.http.auth import presented_key
from gateway.http.errors import GatewayError, UpstreamFailure
from gateway.proxy.attribution import PathPrefix, check_bound, split_api_key
from gateway.proxy.exchange import Caller, Headers
from gateway.proxy.hot_path import Proxy, named_run
from gateway.store.models import CHAT
from gateway.upstream.failures import body_message

ENDPOINT = "messages"  # the label records and metrics carry
MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
PATHS = (MESSAGES, COUNT_TOKENS)
PATH_PREFIX = MESSAGES + "/"  # the rest of Anthropic's messages family (batches) is a 404 in its shape here
# What the chat request carries beside itself for this API (vLLM ignores unknown fields): the fields it ignored.
EXTRA = "trajgate_messages"

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}
# Claude Code puts a per-request hash in a system block; vLLM drops it so the prompt prefix stays cacheable.
_BILLING_HEADER = "x-anthropic-billing-header"
# The tool a template is shown when asked whether its tools variant takes system messages past the first.
_PROBE_TOOL = {"type": "function", "function": {"name": "probe", "parameters": {"type": "object", "properties": {}}}}


# -- the request -------------------------------------------------------------------------------------------------


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    # As vLLM's endpoint takes a tool: any `type` (a server tool's too) is shown to the model as a function, given
    # its input_schema (one without, like web search's, is refused as vLLM refuses it).
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None
    defer_loading: bool | None = None  # a tool a tool search finds (see the `tool_reference` block)


class ToolReference(BaseModel):
    """A tool named by a tool_addition or tool_removal block."""

    type: Literal["tool_reference"]
    name: str


class ToolDefinition(BaseModel):
    """A tool defined by value in a tool_addition block."""

    type: Literal["tool_definition"]
    definition: Tool


_ToolChange = Literal["tool_addition", "tool_removal"]
_TOOL_CHANGES = get_args(_ToolChange)


class Block(BaseModel):
    """A content block as vLLM's endpoint takes one: one model for every kind, each field optional, so a block
    without what its kind would use (a text block without text, a tool_use without an id...) is accepted and converted
    as vLLM converts it (skipped, or given vLLM's default). cache_control, citations and the like are accepted and
    have no effect on a local model."""

    model_config = ConfigDict(extra="allow")
    type: (
        Literal["text", "image", "tool_use", "tool_result", "tool_reference", "thinking", "redacted_thinking"]
        | _ToolChange
    )
    text: str | None = None
    source: dict[str, Any] | None = None  # an image's: base64 unless its type says url, as vLLM reads it
    id: str | None = None
    tool_use_id: str | None = None
    name: str | None = None
    # vLLM's endpoint takes only an object; any JSON value is taken so a client can echo back a tool_use whose
    # arguments were not an object, as the gateway answered it (see _tool_input), and continue the recorded turn.
    input: Any = None
    # A tool result's items as vLLM takes them: text, image and tool_reference are used, any other kind is skipped.
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    tool_name: str | None = None  # a tool_reference's: a tool search's pointer to a deferred tool
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None  # redacted thinking: opaque, accepted so a client can echo an assistant turn back whole
    # tool_addition / tool_removal (in system messages only): the tools in effect change from there on.
    tool: Annotated[ToolReference | ToolDefinition, Field(discriminator="type")] | None = None

    @model_validator(mode="after")
    def _tool_change(self) -> Block:
        if self.type in _TOOL_CHANGES:
            if self.tool is None:
                raise ValueError(f"tool is required for {self.type} blocks")
            if self.type == "tool_removal" and not isinstance(self.tool, ToolReference):
                raise ValueError("tool_removal only accepts a tool_reference")
        return self


def _no_tool_changes(content: str | list[Block] | None) -> None:
    for block in content if isinstance(content, list) else ():
        if block.type in _TOOL_CHANGES:
            raise ValueError(f'{block.type} blocks are only allowed in messages with role "system"')


class Message(BaseModel):
    # A system message mid-conversation (Claude Code's reminders) is kept where it stands, as vLLM's endpoint keeps
    # it for a template that accepts one there.
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]

    @model_validator(mode="after")
    def _tool_changes_in_system_only(self) -> Message:
        if self.role != "system":
            _no_tool_changes(self.content)
        return self


class _Choice(BaseModel):
    disable_parallel_tool_use: bool | None = None


class AutoChoice(_Choice):
    type: Literal["auto"]


class AnyChoice(_Choice):
    type: Literal["any"]


class NamedChoice(_Choice):
    type: Literal["tool"]
    name: str


class NoneChoice(BaseModel):
    type: Literal["none"]


ToolChoice = Annotated[AutoChoice | AnyChoice | NamedChoice | NoneChoice, Field(discriminator="type")]


class ThinkingEnabled(BaseModel):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1024)  # an int as pydantic reads one, 2048.0 and "2048" too, as vLLM's endpoint


class ThinkingDisabled(BaseModel):
    type: Literal["disabled"]


class ThinkingAdaptive(BaseModel):
    type: Literal["adaptive"]


Thinking = Annotated[ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive, Field(discriminator="type")]


class OutputFormat(BaseModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class CountTokensRequest(BaseModel):
    # Unknown fields (Claude Code's context_management, MCP servers, containers...) are ignored, as vLLM's endpoint
    # ignores them; the record names them (see `ignored_fields`), so nothing is dropped unseen.
    model: str
    messages: list[Message]
    system: str | list[Block] | None = None  # only its text blocks are read, as vLLM reads it
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    # Accepted and without effect on one local model: prompt caching is vLLM's own, and there are no speed modes,
    # workspaces or user profiles to route by.
    cache_control: Any = None
    speed: Any = None
    user_profile_id: Any = None
    workspace_id: Any = None

    @field_validator("system")
    @classmethod
    def _system_without_tool_changes(cls, system: str | list[Block] | None) -> str | list[Block] | None:
        _no_tool_changes(system)
        return system


class MessagesRequest(CountTokensRequest):
    # An int as pydantic reads one (8.0, "8" and true are ints; 8.5 is not), as vLLM's endpoint reads it.
    max_tokens: int = Field(gt=0)
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = Field(None, ge=0)  # vLLM takes Anthropic's 0-1 and OpenAI's 0-2 alike
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = None  # vLLM's -1 (no limit) too; its sampler refuses what it cannot take
    metadata: dict[str, Any] | None = None  # its user_id, where a string, is the chat request's `user`
    # Likewise without effect: one tier, one place, and no prompt-cache diagnostics.
    service_tier: Any = None
    inference_geo: Any = None
    diagnostics: Any = None


def ignored_fields(data: dict[str, Any]) -> list[str]:
    """The top-level fields this request carries that change nothing here (vLLM's endpoint ignores them too), for
    the record: a trainer can see that a call asked for, say, Anthropic's context editing and did not get it."""
    return sorted(set(data) - set(MessagesRequest.model_fields))


def _problem(exc: ValidationError) -> str:
    """`where: what` for the first problem that is not a string-or-blocks field failing as a string: a bad block
    in `content` or `system` is named as the block it is, not as "Input should be a valid string"."""
    errors = exc.errors()
    first = next((error for error in errors if error["loc"][-1:] != ("str",)), errors[0])
    # pydantic names a union's branches in the path (`list[...]`); the client's body has no such level.
    where = ".".join(str(part) for part in first["loc"] if "[" not in str(part)) or "body"
    return f"{where}: {first['msg']}"


def parse_request(data: dict[str, Any], model: type[CountTokensRequest]) -> CountTokensRequest:
    try:
        request = model.model_validate(data)
    except ValidationError as exc:
        raise GatewayError(400, _problem(exc)) from None
    if isinstance(request, MessagesRequest) and isinstance(request.thinking, ThinkingEnabled):
        if request.thinking.budget_tokens >= request.max_tokens:
            raise GatewayError(400, "thinking.budget_tokens: must be less than max_tokens")
    return request


# -- Anthropic -> chat -------------------------------------------------------------------------------------------


def to_chat(request: CountTokensRequest, merge_inline_system: bool = False) -> dict[str, Any]:
    """The chat request vLLM's own /v1/messages would build from this one (same messages, tools and sampling), so
    the model sees the prompt it would have seen there. `merge_inline_system`: the model's template wants the system
    prompt first and only there, so system messages met later join it (vLLM's endpoint detects and does the same)."""
    messages: list[dict[str, Any]] = []
    inline = [m for m in request.messages if m.role == "system"] if merge_inline_system else []
    system = _system_text(request.system) + "".join(m["content"] for i in inline for m in _chat_messages(i))
    if system:
        messages.append({"role": "system", "content": system})
    for message in request.messages:
        if not (merge_inline_system and message.role == "system"):
            messages.extend(_chat_messages(message))
    chat: dict[str, Any] = {"model": request.model, "messages": messages}
    if request.messages and request.messages[-1].role == "assistant":
        # A prefilled answer: the model continues it instead of starting a new turn, as Anthropic does.
        chat["add_generation_prompt"] = False
        chat["continue_final_message"] = True
    tools = _tools_in_effect(request)
    if tools:
        chat["tools"] = [_chat_tool(tool) for tool in tools]
    if request.tool_choice is not None and (tools or request.tool_choice.type != "auto"):
        choice = request.tool_choice
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {
            "type": "function",
            "function": {"name": getattr(choice, "name", "")},
        }
        if getattr(choice, "disable_parallel_tool_use", None) is not None:
            chat["parallel_tool_calls"] = not choice.disable_parallel_tool_use  # type: ignore[union-attr]
    elif tools:
        chat["tool_choice"] = "auto"
    # `tools: []` (Claude Code's title call) is no tools: vLLM's endpoint renders it so, where its chat endpoint
    # refuses an empty list, and "auto" without tools.
    if isinstance(request.thinking, ThinkingEnabled):
        chat["thinking_token_budget"] = request.thinking.budget_tokens
    elif isinstance(request.thinking, ThinkingDisabled):
        chat["reasoning_effort"] = "none"
    if request.output_config is not None:
        if request.output_config.effort is not None:
            chat["reasoning_effort"] = request.output_config.effort
        if request.output_config.format is not None:
            schema = {"name": "output", "schema": request.output_config.format.schema_}
            chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    if isinstance(request, MessagesRequest):
        _sampling(request, chat)
    return chat


def _sampling(request: MessagesRequest, chat: dict[str, Any]) -> None:
    chat["max_tokens"] = request.max_tokens
    for name, value in (("temperature", request.temperature), ("top_p", request.top_p), ("top_k", request.top_k)):
        if value is not None:
            chat[name] = value
    if request.stop_sequences:
        chat["stop"] = request.stop_sequences
    user = (request.metadata or {}).get("user_id")
    if isinstance(user, str):
        chat["user"] = user
    if request.stream:
        # The prompt ids in the first chunk give message_start its input_tokens; usage at the end its output_tokens.
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
        chat["return_token_ids"] = True


def _system_text(system: str | list[Block] | None) -> str:
    """The text of a system prompt or message: its text blocks joined (any other block adds nothing), Claude Code's
    billing header left out."""
    if system is None or isinstance(system, str):
        return system or ""
    texts = (block.text for block in system if block.type == "text" and block.text)
    return "".join(text for text in texts if not text.startswith(_BILLING_HEADER))


def _tools_in_effect(request: CountTokensRequest) -> list[Tool] | None:
    """The tools at the end of the conversation, after its tool_addition/tool_removal blocks, as vLLM's endpoint
    resolves them (a chat template shows one tool list): a tool added by reference is no longer deferred, one added
    by value is declared, a removed one is gone. A reference to an undeclared tool is a 400, as there."""
    changes = [
        block
        for message in request.messages
        if not isinstance(message.content, str)
        for block in message.content
        if block.type in _TOOL_CHANGES
    ]
    if not changes:
        return request.tools
    tools = {tool.name: tool for tool in request.tools or ()}
    removed: set[str] = set()
    for block in changes:
        change = block.tool
        if isinstance(change, ToolDefinition):
            name = change.definition.name
            tools[name] = change.definition
        else:
            assert change is not None  # Block's validator
            name = change.name
            if name not in tools:
                raise GatewayError(400, f"{block.type} references tool {name!r}, which is not declared in tools")
            if block.type == "tool_addition":
                tools[name] = tools[name].model_copy(update={"defer_loading": None})
        if block.type == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return [tool for name, tool in tools.items() if name not in removed]


def _chat_tool(tool: Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    # vLLM's endpoint: a schema without a type is an object's, and `strict`/`defer_loading` go on to the template.
    schema = tool.input_schema
    function["parameters"] = schema if "type" in schema else {**schema, "type": "object"}
    for key, value in (("strict", tool.strict), ("defer_loading", tool.defer_loading)):
        if value is not None:
            function[key] = value
    return {"type": "function", "function": function}


def _chat_messages(message: Message) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool results become `tool` messages (before the rest of the user
    turn, as the chat format wants them right after the assistant's calls), tool uses become `tool_calls`."""
    if message.role == "system":
        # vLLM strips Claude Code's billing header here even from a plain string.
        content = message.content
        text = "" if isinstance(content, str) and content.startswith(_BILLING_HEADER) else _system_text(content)
        return [{"role": "system", "content": text}] if text else []
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in message.content:
        # What a block lacks is skipped or defaulted as vLLM's endpoint does; redacted thinking and a bare
        # tool_reference add nothing there either.
        if block.type == "text" and block.text:
            parts.append({"type": "text", "text": block.text})
        elif block.type == "image" and block.source:
            parts.append({"type": "image_url", "image_url": {"url": _source_url(block.source)}})
        elif block.type == "tool_use":
            # as vLLM's endpoint writes them, spaces and all (a missing input is "{}" there)
            arguments = json.dumps({} if block.input is None else block.input)
            function = {"name": block.name or "", "arguments": arguments}
            calls.append({"id": block.id or f"call_{int(time.time())}", "type": "function", "function": function})
        elif block.type == "tool_result":
            out.extend(_tool_result(block, message.role, parts))
        elif block.type == "thinking" and block.thinking is not None:
            reasoning.append(block.thinking)
    chat: dict[str, Any] = {"role": message.role}
    if reasoning:
        chat["reasoning"] = "".join(reasoning)
    if calls:
        chat["tool_calls"] = calls
    if parts:
        chat["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
    if message.role == "assistant" or "content" in chat or calls or reasoning:
        out.append(chat)  # a user turn of nothing but tool results adds no user message
    return out


def _tool_result(block: Block, role: str, parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A tool_result block as vLLM's endpoint converts it: in a user turn, a tool message (then its images as a user
    message, and the tools a tool search found as a tool message of their own); anywhere else, text in the turn."""
    if role != "user":
        # vLLM writes the content as Python prints it, a list of items too.
        parts.append({"type": "text", "text": f"Tool result: {str(block.content) if block.content else ''}"})
        return []
    items = block.content if isinstance(block.content, list) else []
    text = block.content if isinstance(block.content, str) else "\n".join(
        str(item.get("text") or "") for item in items if item.get("type") == "text"
    )
    images = [_source_url(item.get("source")) for item in items if item.get("type") == "image"]
    found = [item.get("tool_name") or item.get("name") for item in items if item.get("type") == "tool_reference"]
    # `is_error` has no chat equivalent; vLLM's endpoint drops it too (the text usually says what went wrong).
    call_id = block.tool_use_id or ""
    out: list[dict[str, Any]] = [{"role": "tool", "tool_call_id": call_id, "content": text}]
    if images:
        out.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}} for url in images]})
    references = [{"type": "tool_reference", "name": name} for name in found if name]
    if references:
        out.append({"role": "tool", "tool_call_id": call_id, "content": references})
    return out


def _source_url(source: Any) -> str:
    """An image source as a URL, as leniently as vLLM reads one (base64 unless its type says `url`)."""
    source = source if isinstance(source, dict) else {}
    if source.get("type") == "url":
        return str(source.get("url") or "")
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


# -- chat -> Anthropic -------------------------------------------------------------------------------------------


def error_body(error: GatewayError, request_id: str | None = None) -> bytes:
    """Any error the gateway or vLLM answers a Messages call with, in Anthropic's shape: its type follows from the
    status alone, as Anthropic's does (the OpenAI type and code have no Anthropic counterpart)."""
    kind = ERROR_TYPES.get(error.status) or ("api_error" if error.status >= 500 else "invalid_request_error")
    body: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": error.message}}
    if request_id:
        body["request_id"] = request_id
    return orjson.dumps(body)


def stop_reason(
    finish_reason: str | None, matched: Any, tool_used: bool, tool_complete: bool
) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a chat finish: vLLM's rules (max_tokens wins; a complete tool call is
    tool_use; a matched stop string, reported as a str in `stop_reason`, is stop_sequence)."""
    if finish_reason == "length":
        return "max_tokens", None
    if tool_complete:
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    if finish_reason == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def _tool_input(arguments: str) -> tuple[Any, bool]:
    """The arguments as `input`, and whether they are JSON (a call cut short by max_tokens is not; its input is then
    empty, the record keeps the tokens). Any JSON value, an object or not, is the input, as vLLM's stream sends it:
    the partial_json deltas join into exactly these arguments and vLLM calls the call complete when they parse.
    (vLLM's non-stream answer is json.loads of them too; its response model then refuses a non-object, a 400 for an
    answer already generated, so the gateway answers what the stream says.)"""
    try:
        return orjson.loads(arguments or "{}"), True
    except orjson.JSONDecodeError:
        return {}, False


def message_id(chat_id: Any) -> str:
    return "msg_" + str(chat_id or "").removeprefix("chatcmpl-")


def to_message(response: dict[str, Any]) -> dict[str, Any]:
    """A chat completion as an Anthropic Message."""
    choices = response.get("choices") or [{}]
    choice = choices[0]
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    calls = message.get("tool_calls") or []
    complete = bool(calls)
    for call in calls:
        function = call.get("function") or {}
        arguments, parsed = _tool_input(function.get("arguments") or "")
        complete = complete and parsed
        content.append({"type": "tool_use", "id": call.get("id"), "name": function.get("name"), "input": arguments})
    if not content:
        content.append({"type": "text", "text": ""})  # Anthropic's shape for an empty answer
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"), bool(calls), complete)
    usage = response.get("usage") or {}
    message = {
        "id": message_id(response.get("id")),
        "type": "message",
        "role": "assistant",
        "model": response.get("model"),
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": {
            "input_tokens": usage.get("prompt_tokens") or 0,
            "output_tokens": usage.get("completion_tokens") or 0,
        },
    }
    if sequence is None:
        del message["stop_sequence"]  # vLLM's endpoint leaves out what is null
    return message


def _event(name: str, data: dict[str, Any]) -> bytes:
    return sse.frame(orjson.dumps(data), event=name)


class StreamTranslator:
    """Chat completion chunks in, Anthropic stream events out: message_start, ping, a content block per text run,
    thinking run or tool call (start, deltas, stop), then message_delta (stop reason, usage) and message_stop."""

    def __init__(self) -> None:
        self.started = False
        self.finished = False
        self.failed = False
        self.block: int | None = None  # index of the open content block
        self.block_kind: str | None = None
        self.blocks = 0
        self.tool_blocks: dict[int, int] = {}  # chat tool-call index -> content block index
        self.tool_arguments: dict[int, list[str]] = {}
        self.input_tokens = 0
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.matched: Any = None

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        """One chunk the chat path answers with (vLLM's error event too); returns the events to send (none once the
        stream failed). `finish` takes the chat stream's `[DONE]`."""
        if self.failed:
            return []
        if "error" in chunk and "choices" not in chunk:
            error = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
            return self.fail(str(error.get("message") or "upstream error"))
        out = [] if self.started else self._start(chunk)
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning") or delta.get("reasoning_content")
            if reasoning:
                out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta(self.block, {"type": "thinking_delta", "thinking": reasoning}))
            if delta.get("content"):
                out += self._open("text", {"type": "text", "text": ""})
                out.append(self._delta(self.block, {"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or ():
                out += self._tool_call(call)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
                self.matched = choice.get("stop_reason")
        return out

    def _start(self, chunk: dict[str, Any]) -> list[bytes]:
        self.started = True
        prompt = chunk.get("prompt_token_ids")
        self.input_tokens = len(prompt) if isinstance(prompt, list) else 0
        message: dict[str, Any] = {
            "id": message_id(chunk.get("id")),
            "type": "message",
            "role": "assistant",
            "model": chunk.get("model"),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
        }
        start = _event("message_start", {"type": "message_start", "message": message})
        return [start, _event("ping", {"type": "ping"})]

    def _open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        if self.block_kind == kind and kind != "tool_use":
            return []
        out = self._close()
        self.block, self.block_kind = self.blocks, kind
        self.blocks += 1
        start = {"type": "content_block_start", "index": self.block, "content_block": block}
        out.append(_event("content_block_start", start))
        return out

    def _close(self) -> list[bytes]:
        if self.block is None:
            return []
        event = _event("content_block_stop", {"type": "content_block_stop", "index": self.block})
        self.block = self.block_kind = None
        return [event]

    @staticmethod
    def _delta(index: int | None, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})

    def _tool_call(self, call: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        position = call.get("index", 0)
        function = call.get("function") or {}
        if position not in self.tool_blocks:
            block: dict[str, Any] = {
                "type": "tool_use", "id": call.get("id"), "name": function.get("name") or "", "input": {}
            }
            out += self._open("tool_use", block)
            assert self.block is not None
            self.tool_blocks[position] = self.block
            self.tool_arguments[position] = []
        if function.get("arguments"):
            self.tool_arguments[position].append(function["arguments"])
            # Sent against the call's own block: the SDK accumulates deltas by index.
            delta = {"type": "input_json_delta", "partial_json": function["arguments"]}
            out.append(self._delta(self.tool_blocks[position], delta))
        return out

    def finish(self) -> list[bytes]:
        if self.finished or self.failed:
            return []
        out = [] if self.started else self._start({})
        self.finished = True
        out += self._close()
        tool_used = bool(self.tool_blocks)
        complete = tool_used and all(_tool_input("".join(parts))[1] for parts in self.tool_arguments.values())
        reason, sequence = stop_reason(self.finish_reason, self.matched, tool_used, complete)
        usage = self.usage or {}
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        counts = {
            "input_tokens": usage.get("prompt_tokens") or self.input_tokens,
            "output_tokens": usage.get("completion_tokens") or 0,
        }
        out.append(_event("message_delta", {"type": "message_delta", "delta": delta, "usage": counts}))
        out.append(_event("message_stop", {"type": "message_stop"}))
        return out

    def fail(self, message: str) -> list[bytes]:
        """An error mid-stream, told in-band as Anthropic does (the status line is already sent)."""
        if self.failed or self.finished:
            return []
        self.failed = True
        return [_event("error", {"type": "error", "error": {"type": "api_error", "message": message}})]


class AnthropicAnswer:
    """The call's `Answer` (gateway/proxy/exchange.py): the chat path's answer, as dicts, rewritten into a Message,
    an Anthropic error or Anthropic's stream events. A read's chunks are translated when it is flushed, so a read
    that fails gives the client nothing of its own, as the chat client."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.stream = StreamTranslator()
        self._pending: list[dict[str, Any] | None] = []  # the chunks of the read not flushed yet; None: [DONE]

    async def error(self, error: GatewayError, headers: Headers) -> None:
        await self._whole(error.status, None, error, headers)

    async def answer(self, response: dict[str, Any], content_type: bytes, headers: Headers) -> None:
        await self._whole(200, response, None, headers)

    async def passthrough(self, status: int, body: bytes, content_type: bytes, headers: Headers) -> None:
        error = GatewayError(status, body_message(body)) if status != 200 else None
        await self._whole(status, None, error, headers)

    async def _whole(
        self, status: int, response: dict[str, Any] | None, error: GatewayError | None, headers: Headers
    ) -> None:
        """A Message for a chat completion; an Anthropic error for an error; a 502 for a 200 that is neither."""
        headers, request_id = _anthropic_headers(headers)
        body = b""
        if error is None and response is not None:
            try:
                body = orjson.dumps(to_message(response))
            except (AttributeError, TypeError):
                response = None
        if error is None and response is None:
            error = GatewayError(502, "vLLM sent a body that is not a chat completion", "upstream_error")
        if error is not None:
            status, body = error.status, error_body(error, request_id)
        head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
        await self._send({"type": "http.response.start", "status": status, "headers": head})
        await self._send({"type": "http.response.body", "body": body})

    async def start(self, headers: Headers) -> None:
        await sse.start_stream(self._send, _anthropic_headers(headers)[0], 200, sse.EVENT_STREAM + b"; charset=utf-8")

    def chunk(self, chunk: dict[str, Any]) -> None:
        self._pending.append(chunk)

    def error_chunk(self, chunk: dict[str, Any], payload: bytes) -> None:
        self._pending.append(chunk)  # the translator tells it as Anthropic's error event

    def done(self) -> None:
        self._pending.append(None)

    async def flush(self) -> None:
        out: list[bytes] = []
        for chunk in self._pending:
            out += self.stream.finish() if chunk is None else self.stream.feed(chunk)
        self._pending.clear()
        await self._body(out, more=True)

    async def broke(self, message: str) -> None:
        self._pending.clear()
        await self._body(self.stream.fail(message), more=True)

    async def end(self) -> None:
        stream = self.stream
        out = []
        if stream.started and not (stream.finished or stream.failed):
            out = stream.fail("the stream ended before the answer was complete")
        await self._body(out, more=False)

    async def _body(self, out: list[bytes], more: bool) -> None:
        if out or not more:
            await self._send({"type": "http.response.body", "body": b"".join(out), "more_body": more})


def _anthropic_headers(headers: Headers) -> tuple[Headers, str | None]:
    """The chat path's answer headers with the request id also where the Anthropic SDK looks for it
    (`request-id`), and that id."""
    shown: Headers = []
    request_id = None
    for name, value in headers:
        shown.append((name, value))
        if name == b"x-request-id":
            request_id = value.decode()
            shown.append((b"request-id", value))
    return shown, request_id


# -- the endpoints -----------------------------------------------------------------------------------------------


class MessagesApi:
    """`/v1/messages` and `/v1/messages/count_tokens`, in front of the proxy's chat path."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self._merges_inline_system: dict[str, bool] = {}  # by served model: its template wants one system prompt

    async def _merge_inline_system(self, run: str, request: CountTokensRequest) -> bool:
        """Whether this request's system messages past the first must join the system prompt: vLLM's endpoint
        renders [system, user, system, user] with the model's template, and with the template it uses when tools are
        given (a model may have another), and merges if either refuses. Asked of vLLM's render endpoint once per
        served model; a vLLM that cannot render (no --enable-scale-out) keeps them in place, as does one whose
        answer says nothing yet (asked again next time)."""
        if not any(message.role == "system" for message in request.messages):
            return False
        served = self.proxy.router.resolve(run, await self.proxy.base_model()).served_name
        if served not in self._merges_inline_system:
            probe = [{"role": role, "content": "t"} for role in ("system", "user", "system", "user")]
            try:
                merge = not await self._renders(served, probe)
                # The tools' template is picked only when tools are sent, and vLLM refuses an empty list, so one
                # stands in; where the template takes it with one system message, a refusal with two is the order's.
                if not merge and await self._renders(served, probe[:2], [_PROBE_TOOL]):
                    merge = not await self._renders(served, probe, [_PROBE_TOOL])
                self._merges_inline_system[served] = merge
            except UpstreamFailure as failure:
                if failure.error.status not in (403, 404):  # no render endpoint: kept in place for good
                    return False
                self._merges_inline_system[served] = False
        return self._merges_inline_system[served]

    async def _renders(self, served: str, messages: list[dict[str, Any]], tools: list[Any] | None = None) -> bool:
        """Whether the model's template renders these messages (vLLM answers a template's refusal with a 400)."""
        body: dict[str, Any] = {"model": served, "messages": messages, "add_generation_prompt": False}
        if tools:
            body["tools"] = tools
        try:
            await self.proxy.token_in.render(body)
        except UpstreamFailure as failure:
            if failure.error.status == 400:
                return False
            raise
        return True

    async def handle(self, scope: Scope, receive: Receive, send: Send, prefix: PathPrefix | None) -> None:
        path = prefix.rest if prefix else scope["path"]
        if path not in PATHS:
            message = f"{path} is not served here: only /v1/messages and its count_tokens"
            await _send_error(send, GatewayError(404, message))
            return
        if scope["method"] != "POST":
            message = f"{scope['method']} is not allowed here; use POST"
            await _send_error(send, GatewayError(405, message), ((b"allow", b"POST"),))
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            # The key first, as Anthropic checks it: an unauthenticated caller learns nothing about its body.
            key, key_group, key_trajectory = split_api_key(presented_key(headers))
            runs = self.proxy.auth.check_agent(key)
            data = _parse(await self.proxy.read_body(receive, headers))
            run = named_run(headers, data)  # X-Run, else `model`, as the chat path names it
            if runs is not None:  # a bound key's run, before vLLM is asked anything (the chat path asks again)
                check_bound(run, runs)
            if path == COUNT_TOKENS:
                counted = parse_request(data, CountTokensRequest)
                count = await self._count_tokens(run, counted, await self._merge_inline_system(run, counted))
                # vLLM's answer: nothing is edited out of the context here, so the original count is the count.
                body = orjson.dumps({"input_tokens": count, "context_management": {"original_input_tokens": count}})
                await _send_bytes(send, 200, body, [(b"content-type", b"application/json")])
                return
            request = parse_request(data, MessagesRequest)
            chat = to_chat(request, await self._merge_inline_system(run, request))
            ignored = ignored_fields(data)
            if ignored:
                chat[EXTRA] = {"ignored": ignored}
            size = _chat_size(chat)
        except (GatewayError, UpstreamFailure) as exc:
            error = exc.error if isinstance(exc, UpstreamFailure) else exc
            self.proxy.metrics.count_request(ENDPOINT, error.status)
            await _send_error(send, error)
            return
        caller = Caller(
            self.proxy.new_request_id(), ENDPOINT, CHAT, time.perf_counter(), time.time(), headers, prefix,
            key_group, key_trajectory, runs, size,
        )  # fmt: skip
        await self.proxy.serve(chat, caller, receive, AnthropicAnswer(send))

    async def _count_tokens(self, run: str, request: CountTokensRequest, merge_inline_system: bool) -> int:
        """The prompt's exact length as vLLM renders it (its scale-out render endpoint, which token_in uses too)
        for the model serving `run`."""
        route = self.proxy.router.resolve(run, await self.proxy.base_model())
        chat = to_chat(request, merge_inline_system)
        chat["model"] = route.served_name
        _chat_size(chat)  # the depth check
        return len(await self.proxy.token_in.render(chat))


def _parse(body: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise GatewayError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise GatewayError(400, "request body must be a JSON object")
    return data


def _chat_size(chat: dict[str, Any]) -> int:
    """The chat request's size as JSON, which the chat path holds to the body limit (it is what is recorded); a 400
    in Anthropic's shape for one it could neither forward nor record: orjson writes at most 254 levels of nesting
    (the proxy would refuse it in OpenAI's words)."""
    try:
        return len(orjson.dumps(chat))
    except orjson.JSONEncodeError:
        raise GatewayError(400, "request body is nested too deeply") from None


async def _send_bytes(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _send_error(send: Send, error: GatewayError, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    await _send_bytes(send, error.status, error_body(error), [(b"content-type", b"application/json"), *headers])
