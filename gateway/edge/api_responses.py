"""The OpenAI Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`), translated at the edge to the chat path.

vLLM's own `/v1/responses` returns no token ids or per-token logprobs, and it converts a Responses request to chat
messages internally anyway; so the gateway does that conversion itself and sends the chat request through the proxy's one path (`Proxy.serve`),
which answers in dicts that `_Answer` turns into a Response object or Responses events. Attribution, retries, the token_in
mode, records and the trainer then work as for any chat call; only the record's endpoint label says `responses`.

- The response id is the gateway's request id (`req-<hex>` -> `resp_<hex>`), so a recorded answer can be found again;
  for this API it is 128 random bits, not the per-process base and counter of other calls, so it cannot be guessed.
- A stored response belongs to the agent key that created it (its fingerprint, `Auth.tenant`, kept with the record
  under `trajgate_responses` and never sent upstream): fetched or continued with another key it is a 404, exactly as
  an unknown id. With agent auth off there is one tenant.
- A key bound to runs (tenants, `Auth.check_agent`) sees only the stored responses of those runs: another run's
  response, fetched or continued, is the same 404 as an unknown id (its own run's binding may have changed since).
- `previous_response_id`: the earlier call's chat messages plus its answer, then this input. Kept in memory up to
  TRAJGATE_RESPONSES_MEMORY_BYTES (oldest dropped first); otherwise read from the database (the record of another
  gateway, or of this one before a restart), waiting up to TRAJGATE_TOKEN_STATE_WAIT_S for a record still in a
  writer's queue. `store: false` is honoured: such an answer is recorded for training but cannot be continued or
  fetched.
- Tools as vLLM's own endpoint treats them: function tools are served, a namespace's functions are flattened to
  `<namespace>__<name>` (and a call of one comes back with its `namespace`), a free-form `custom` tool (Codex's
  `apply_patch`) is shown as a function of one string `input` (a call of it comes back as a `custom_tool_call` with
  that string, and one sent back as input goes to the model as that function call), and every other tool type (web
  search, file search, MCP, code interpreter...) is dropped: it would run server-side between generations, which
  vLLM doesn't do. A custom tool with a grammar format (Codex's `apply_patch` for a model named like OpenAI's) is
  dropped too: vLLM refuses the whole request for it, and dropping it keeps such a session going. Unknown fields
  (Codex's `client_metadata`...) are ignored as vLLM ignores them; vLLM's own sampling extras (`top_k`, `seed`,
  `stop`...) go on to the chat request.
- What the chat request cannot say is kept beside it under `trajgate_responses` (vLLM ignores unknown fields): whether
  its first message is the `instructions` (which a continuation does not carry over, as in OpenAI's API), the
  `metadata`, the namespaces and the custom tools, so `GET` rebuilds the Response object from the record; and, for
  whoever reads the record, the tools the model could not run (`dropped_tools`) and the fields that changed nothing
  (`ignored`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import secrets
import time
from collections import OrderedDict
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from starlette.types import Receive, Scope, Send

from gateway.http import sse
from gateway.http.auth import presented_key
from gateway.http.deps import agent_runs, gateway_state, json_response, require_agent
from gateway.http.errors import GatewayError
from gateway.proxy import capture
from gateway.proxy.asgi_io import send_bytes
from gateway.proxy.attribution import PathPrefix, split_api_key
from gateway.proxy.exchange import Caller, Headers
from gateway.proxy.hot_path import Proxy, parse_json
from gateway.store.exchanges import RecordedExchange, recorded_exchange
from gateway.store.models import CHAT

ENDPOINT = "responses"  # the record's endpoint label
PATH = "/v1/responses"
EXTRA = "trajgate_responses"  # what the chat request carries for this API (see the module's docstring)
OWNER = "owner"  # the key of EXTRA naming the tenant; capture.prepare_upstream leaves it out of what vLLM gets
RESPONSE_ID_RE = re.compile(r"^resp_([0-9a-f]{32})$")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_POLL_S = 0.05
_READ_TIMEOUT_S = 5.0

# Fields a Responses request may carry that change nothing here: accepted and ignored (vLLM's own endpoint ignores
# them too), as is any field not named here at all; those the record lists under `ignored`.
_IGNORED = frozenset(
    {
        "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options", "reasoning",
        "safety_identifier", "service_tier", "stream_options", "truncation", "max_tool_calls", "context_management",
    }
)  # fmt: skip
_TRANSLATED = frozenset(
    {
        "model", "input", "instructions", "previous_response_id", "tools", "tool_choice", "parallel_tool_calls",
        "max_output_tokens", "temperature", "top_p", "top_logprobs", "stream", "store", "user", "text", "background",
        "prompt", "include", "metadata",
    }
)  # fmt: skip
# vLLM's extensions of a Responses request that its chat endpoint takes under the same names, passed on as they are.
_PASSED = (
    "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "seed", "stop",
    "stop_token_ids", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "structured_outputs",
    "chat_template_kwargs", "cache_salt",
)  # fmt: skip
NAMESPACE_SEPARATOR = "__"  # vLLM's: a namespace's function is shown to the model as <namespace>__<name>
# vLLM's shim for a free-form custom tool: a function of one string, whose arguments are {"input": <the text>}.
CUSTOM_INPUT_KEY = "input"
CUSTOM_PARAMETERS = {
    "type": "object",
    "properties": {CUSTOM_INPUT_KEY: {"type": "string", "description": "The freeform text payload for this tool."}},
    "required": [CUSTOM_INPUT_KEY],
    "additionalProperties": False,
}


# -- Responses request -> chat request -------------------------------------------------------------------------------


def _bad(message: str, code: str = "invalid_value") -> GatewayError:
    return GatewayError(400, message, code=code)


def _text_of(content: Any, where: str) -> str:
    """Text of an assistant message or a tool output: a string, or parts whose text is joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}: expected a string or a list of content parts")
    texts: list[str] = []
    for part in content:
        text = part.get("text", part.get("refusal")) if isinstance(part, dict) else None
        if not isinstance(text, str):
            raise _bad(f"{where}: only text parts are supported here")
        texts.append(text)
    return "".join(texts)


def _user_content(content: Any, where: str) -> Any:
    """A user/system message's content in chat form: a string stays one; input_text -> text, input_image -> image_url."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}: expected a string or a list of content parts")
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            image: dict[str, Any] = {"url": part["image_url"]}
            if part.get("detail") in ("low", "high", "auto"):
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            raise _bad(f"{where}[{i}]: content part {kind!r} is not supported (text and image URLs are)")
    return parts


def _tool_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise _bad(f"{where}.{key}: expected a string")
    name = item["name"]
    if isinstance(item.get("namespace"), str) and item["namespace"]:
        name = item["namespace"] + NAMESPACE_SEPARATOR + name  # as the model called it
    return {"id": item["call_id"], "type": "function", "function": {"name": name, "arguments": item["arguments"]}}


def custom_arguments(text: str) -> str:
    """A custom tool's free-form input as the arguments of its function shim, as vLLM writes them."""
    return json.dumps({CUSTOM_INPUT_KEY: text}, ensure_ascii=False)


def custom_input(arguments: str) -> str:
    """The free-form input in a custom tool's function-shim arguments; text that is not the shim's JSON is taken as
    the input itself, as vLLM takes it (a model may write the payload bare)."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    value = parsed.get(CUSTOM_INPUT_KEY) if isinstance(parsed, dict) else None
    return value if isinstance(value, str) else arguments


def _custom_tool_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    for key in ("call_id", "name"):
        if not isinstance(item.get(key), str):
            raise _bad(f"{where}.{key}: expected a string")
    if not isinstance(item.get("input"), str):
        raise _bad(f"{where}.input: expected a string")
    function = {"name": item["name"], "arguments": custom_arguments(item["input"])}
    return {"id": item["call_id"], "type": "function", "function": function}


def input_messages(items: list[Any], where: str = "input") -> list[dict[str, Any]]:
    """Responses input items as chat messages, the inverse of `output_items`: an assistant message followed by its
    function calls becomes one assistant message with `tool_calls`, as the model answered it in chat form."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{at}: expected an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role == "assistant":
                messages.append({"role": "assistant", "content": _text_of(item.get("content"), f"{at}.content")})
            elif role in ("user", "system", "developer"):
                content = _user_content(item.get("content"), f"{at}.content")
                # A developer message goes on as one: vLLM's renderer makes it (and every system message) one
                # system prompt where the template knows no developer role, as it does for its own endpoint.
                messages.append({"role": role, "content": content})
            else:
                raise _bad(f"{at}.role: expected user, assistant, system or developer")
        elif kind in ("function_call", "custom_tool_call"):
            call = _tool_call(item, at) if kind == "function_call" else _custom_tool_call(item, at)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            if not isinstance(item.get("call_id"), str):
                raise _bad(f"{at}.call_id: expected a string")
            output = _text_of(item.get("output"), f"{at}.output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind == "reasoning":
            continue  # the chat path feeds no reasoning back to the model (nor does vLLM's chat template)
        else:
            raise _bad(
                f"{at}: input item type {kind!r} is not supported: trajgate serves messages and function calls "
                "(built-in tools and item references are not available)",
                "unsupported_item",
            )
    return messages


def _chat_function(tool: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    if not isinstance(tool.get("name"), str):
        raise _bad(f"{where}.name: expected a string")
    function = {k: tool[k] for k in ("description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": {"name": name, **function}}


@dataclasses.dataclass(slots=True)
class _Tools:
    """A request's tools as the chat request shows them, and what the answer and the record need to know of them."""

    chat: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # what the model is shown
    namespaces: list[str] = dataclasses.field(default_factory=list)  # flattened into `chat`
    custom: list[str] = dataclasses.field(default_factory=list)  # custom tools, shown as function shims
    dropped: list[str] = dataclasses.field(default_factory=list)  # by type, or `type:name`


def _free_form(tool: dict[str, Any]) -> bool:
    fmt = tool.get("format")
    return not (isinstance(fmt, dict) and fmt.get("type") == "grammar")


def _custom_function(tool: dict[str, Any], where: str) -> dict[str, Any]:
    name = tool.get("name")
    if not isinstance(name, str):
        raise _bad(f"{where}.name: expected a string")
    function = _chat_function({**tool, "parameters": CUSTOM_PARAMETERS}, name, where)
    function["function"].pop("strict", None)  # the shim is vLLM's, whatever the tool says
    return function


def _chat_tools(tools: Any) -> _Tools:
    """vLLM's `get_function_tools`, which renders only what the model can call: function tools, a namespace's
    functions, and free-form custom tools as function shims; every other tool is dropped."""
    if not isinstance(tools, list):
        raise _bad("tools: expected a list")
    out = _Tools()
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            out.chat.append(_chat_function(tool, tool.get("name"), f"tools[{i}]"))
        elif kind == "custom" and _free_form(tool):
            out.chat.append(_custom_function(tool, f"tools[{i}]"))
            out.custom.append(tool["name"])
        elif kind == "namespace" and isinstance(tool.get("name"), str) and isinstance(tool.get("tools"), list):
            out.namespaces.append(tool["name"])
            for j, inner in enumerate(tool["tools"]):
                if isinstance(inner, dict) and inner.get("type") == "function":
                    flat = f"{tool['name']}{NAMESPACE_SEPARATOR}{inner.get('name')}"
                    out.chat.append(_chat_function(inner, flat, f"tools[{i}].tools[{j}]"))
        else:
            name = tool.get("name") if isinstance(tool, dict) else None
            out.dropped.append(f"{kind}:{name}" if isinstance(name, str) else str(kind))
    return out


def _partial(items: list[Any]) -> bool:
    """vLLM's `should_continue_final_message`: the last input item is a message or reasoning item whose status
    says it is unfinished."""
    last = items[-1] if items else None
    return isinstance(last, dict) and last.get("type", "message") in ("message", "reasoning") and last.get(
        "status"
    ) in ("in_progress", "incomplete")


def _tool_name(name: str, tools: _Tools) -> str:
    """A named tool choice's name as the model knows the tool: a namespace's function may be named without its
    namespace where only one namespace has it (vLLM's `_resolve_named_tool_choice`)."""
    shown = {tool["function"]["name"] for tool in tools.chat}
    if name in shown:
        return name
    flat = [f"{namespace}{NAMESPACE_SEPARATOR}{name}" for namespace in tools.namespaces]
    found = [candidate for candidate in flat if candidate in shown]
    if len(found) > 1:
        raise _bad(
            f"tool_choice: {name!r} is in more than one namespace ({', '.join(found)}); name it as "
            "<namespace>__<name>",
            "unsupported_tool",
        )
    return found[0] if found else name  # an unknown name: vLLM's chat endpoint says so


def _chat_tool_choice(choice: Any, tools: _Tools) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    # A named custom tool is its function shim, as vLLM names it.
    named = isinstance(choice, dict) and choice.get("type") in ("function", "custom")
    if named and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": _tool_name(choice["name"], tools)}}
    raise _bad("tool_choice: expected auto, none, required or {type: function or custom, name}", "unsupported_tool")


def _response_format(text: Any) -> dict[str, Any] | None:
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None or not isinstance(fmt, dict) or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": schema}
    raise _bad(f"text.format: type {fmt.get('type')!r} is not supported")


def chat_request(body: dict[str, Any], previous: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The chat request that asks the model what this Responses request asks; `previous` is the conversation so far
    when it continues an earlier response (without that response's instructions)."""
    ignored = sorted(set(body) - _TRANSLATED - _IGNORED - set(_PASSED))
    # vLLM's endpoint reads no `conversation` (it is ignored, and named in the record); a prompt template it refuses.
    if body.get("prompt") is not None:
        raise _bad("prompt: not supported by trajgate (send the input, or use previous_response_id)")
    if body.get("background"):
        raise _bad("background: not supported by trajgate (responses are answered while the client waits)")
    raw_input = body.get("input")
    if isinstance(raw_input, str):
        items = [{"role": "user", "content": raw_input}]
    elif isinstance(raw_input, list):
        items = raw_input
    else:
        raise _bad("input: expected a string or a list of input items")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("instructions: expected a string")
    messages = [{"role": "system", "content": instructions}] if instructions is not None else []
    messages += list(previous or ()) + input_messages(items)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    if _partial(items) and messages and messages[-1]["role"] == "assistant":
        # An unfinished answer sent back last is continued, not answered anew, as vLLM's endpoint does.
        chat["add_generation_prompt"] = False
        chat["continue_final_message"] = True
    tools = _chat_tools(body["tools"]) if body.get("tools") else _Tools()
    if tools.chat:
        chat["tools"] = tools.chat
    if body.get("tool_choice") is not None and ("tools" in chat or body["tool_choice"] != "auto"):
        # vLLM's default, said or not; only chat refuses "auto" without tools (all of them may have been dropped)
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"], tools)
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            chat[key] = body[key]
    include = body.get("include") or ()
    if body.get("top_logprobs") is not None or (isinstance(include, list) and LOGPROBS_INCLUDE in include):
        chat["logprobs"] = True
        if body.get("top_logprobs") is not None:
            chat["top_logprobs"] = body["top_logprobs"]
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    user = body.get("user") or body.get("safety_identifier")
    if user is not None:
        chat["user"] = user
    if body.get("store") is False:
        chat["store"] = False
    for key in _PASSED:
        if body.get(key) is not None:
            chat[key] = body[key]
    if capture.vllm_bool(body.get("stream")):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise _bad("metadata: expected an object")
    extra = {
        "instructions": instructions is not None, "metadata": metadata, "namespaces": tools.namespaces,
        "custom_tools": tools.custom, "dropped_tools": tools.dropped, "ignored": ignored,
        "verbosity": body["text"].get("verbosity") if isinstance(body.get("text"), dict) else None,
    }  # fmt: skip
    chat[EXTRA] = {k: v for k, v in extra.items() if v}
    return chat


# -- chat answer -> Response object ----------------------------------------------------------------------------------


def _output_logprobs(entries: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    return [
        {
            "token": entry.get("token", ""),
            "bytes": entry.get("bytes") or [],
            "logprob": entry.get("logprob"),
            "top_logprobs": [
                {"token": top.get("token", ""), "bytes": top.get("bytes") or [], "logprob": top.get("logprob")}
                for top in entry.get("top_logprobs") or ()
            ],
        }
        for entry in entries or ()
    ]


def _tool_call_item(call: dict[str, Any], item_id: str, extra: dict[str, Any]) -> dict[str, Any]:
    """A chat tool call (`name` and `arguments` as far as they are known) as the output item vLLM makes of it: a
    custom tool's call is a `custom_tool_call` with its free-form input, a namespace's function is named as in the
    request with its `namespace`, any other is a `function_call`."""
    name, arguments = call["name"], call["arguments"]
    if name in (extra.get("custom_tools") or ()):
        return {"type": "custom_tool_call", "id": "ctc_" + item_id, "call_id": call["call_id"], "name": name,
                "input": custom_input(arguments) if arguments else ""}  # fmt: skip
    item = {"type": "function_call", "id": "fc_" + item_id, "call_id": call["call_id"], "name": name,
            "arguments": arguments, "status": "completed"}  # fmt: skip
    namespace, _, bare = name.partition(NAMESPACE_SEPARATOR)
    if bare and namespace in (extra.get("namespaces") or ()):
        item.update(name=bare, namespace=namespace)
    return item


def output_items(choice: dict[str, Any], hex_id: str, extra: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat choice as Response output items: reasoning, the message, then one item per tool call (see
    `_tool_call_item`). Every item is `completed`, a cut-off one too: vLLM's endpoint says so of each item and puts
    the cut in the Response's own status. Item ids derive from the response id, so rebuilding the answer from its
    record gives the same ids."""
    message = choice.get("message") or {}
    items: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        items.append(
            {"type": "reasoning", "id": f"rs_{hex_id}", "summary": [], "status": "completed",
             "content": [{"type": "reasoning_text", "text": reasoning}]}
        )  # fmt: skip
    if message.get("content"):
        part: dict[str, Any] = {"type": "output_text", "text": message["content"], "annotations": []}
        logprobs = choice.get("logprobs")
        if logprobs and logprobs.get("content") is not None:
            part["logprobs"] = _output_logprobs(logprobs["content"])
        items.append(
            {"type": "message", "id": f"msg_{hex_id}", "role": "assistant", "status": "completed", "content": [part]}
        )
    for i, call in enumerate(message.get("tool_calls") or ()):
        function = call.get("function") or {}
        known = {"call_id": call.get("id") or f"call_{hex_id}_{i}", "name": str(function.get("name") or ""),
                 "arguments": function.get("arguments") or ""}  # fmt: skip
        items.append(_tool_call_item(known, f"{hex_id}_{i}", extra))
    return items


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not usage:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    # The per-turn and tool counts are vLLM's (for built-in tools it would run between turns): one turn, no tools.
    return {
        "input_tokens": usage.get("prompt_tokens", 0),
        "input_tokens_details": {
            "cached_tokens": cached, "cache_write_tokens": 0, "input_tokens_per_turn": [], "cached_tokens_per_turn": [],
        },
        "output_tokens": usage.get("completion_tokens", 0),
        "output_tokens_details": {
            "reasoning_tokens": 0, "tool_output_tokens": 0, "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": usage.get("total_tokens", 0),
    }  # fmt: skip


def _echo_tools(chat: dict[str, Any]) -> list[dict[str, Any]]:
    tools = []
    for tool in chat.get("tools") or ():
        function = tool.get("function") or {}
        tools.append({"type": "function", "strict": function.get("strict"), **function})
    return tools


def _echo_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        return {"type": "function", "name": (choice.get("function") or {}).get("name")}
    return choice or "auto"


def _echo_text(chat: dict[str, Any]) -> dict[str, Any]:
    fmt = chat.get("response_format")
    verbosity = (chat.get(EXTRA) or {}).get("verbosity")
    text: dict[str, Any] = {"verbosity": verbosity} if verbosity else {}
    if fmt is None:
        return {"format": {"type": "text"}, **text}
    if fmt.get("type") == "json_schema":
        return {"format": {"type": "json_schema", **(fmt.get("json_schema") or {})}, **text}
    return {"format": fmt, **text}


def response_object(
    response_id: str,
    chat: dict[str, Any],
    answer: dict[str, Any] | None,
    status: str | None = None,
    previous_response_id: str | None = None,
) -> dict[str, Any]:
    """The Response object for a chat request and its (non-stream or assembled) answer; `answer` None gives the
    in-progress shell a stream starts with. The previous response's id is known only while the call is answered
    (sent upstream it would make identical requests differ), so one rebuilt from its record has none."""
    hex_id = response_id.removeprefix("resp_")
    extra = chat.get(EXTRA) or {}
    choice = ((answer or {}).get("choices") or [{}])[0]
    finish = choice.get("finish_reason")
    if status is None:
        status = "in_progress" if answer is None else "incomplete" if finish == "length" else "completed"
    messages = chat.get("messages") or []
    instructions = messages[0].get("content") if extra.get("instructions") and messages else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": (answer or {}).get("created") or int(time.time()),
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": instructions,
        "max_output_tokens": chat.get("max_tokens"),
        "model": chat.get("model"),
        "output": output_items(choice, hex_id, extra) if answer is not None else [],
        "parallel_tool_calls": chat.get("parallel_tool_calls", True),
        "previous_response_id": previous_response_id,
        "reasoning": None,
        "store": chat.get("store", True),
        "temperature": chat.get("temperature"),
        "text": _echo_text(chat),
        "tool_choice": _echo_tool_choice(chat.get("tool_choice")),
        "tools": _echo_tools(chat),
        "top_logprobs": chat.get("top_logprobs"),
        "top_p": chat.get("top_p"),
        "truncation": "disabled",
        "background": False,
        "service_tier": "auto",
        "presence_penalty": chat.get("presence_penalty", 0.0),
        "frequency_penalty": chat.get("frequency_penalty", 0.0),
        "usage": _usage((answer or {}).get("usage")),
        "user": chat.get("user"),
        "metadata": extra.get("metadata") or {},
    }


def continuation(chat: dict[str, Any], response: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation a later call continues from: the request's messages (its instructions left out) and the
    answer, turned back into chat messages the way its output items would be sent as input."""
    messages = list(chat.get("messages") or ())
    if (chat.get(EXTRA) or {}).get("instructions"):
        messages = messages[1:]
    return messages + input_messages(response["output"], "previous response output")


# -- the adapter -----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class _Kept:
    conversation: list[dict[str, Any]]
    response: dict[str, Any]
    owner: str | None  # Auth.tenant of the key that created it
    # The run of one read back from its record, which the reader's key must be bound to (bindings may have changed
    # since it was made); None for one this process made: its owner's key was checked against these bindings then.
    run: str | None
    size: int = 0  # bytes of the conversation and the response as JSON: what it counts against the memory bound


def owner_of(chat: dict[str, Any]) -> str | None:
    """The tenant a recorded Responses call belongs to (None: made with agent auth off)."""
    extra = chat.get(EXTRA)
    owner = extra.get(OWNER) if isinstance(extra, dict) else None
    return owner if isinstance(owner, str) else None


class ResponsesAPI:
    """Holds recent stored responses (up to `memory_bytes` of them as JSON, oldest dropped first: the record stays
    the fallback) and runs each Responses call through the proxy's chat path."""

    def __init__(self, proxy: Proxy, engine: Engine | None, wait_s: float, memory_bytes: int) -> None:
        self.proxy = proxy
        self.engine = engine
        self.wait_s = wait_s
        self.memory_bytes = memory_bytes
        self.kept_bytes = 0
        self._kept: OrderedDict[str, _Kept] = OrderedDict()

    @property
    def kept_count(self) -> int:
        return len(self._kept)

    def remember(self, chat: dict[str, Any], response: dict[str, Any]) -> None:
        if chat.get("store") is False or self.memory_bytes == 0:
            return
        kept = _Kept(continuation(chat, response), response, owner_of(chat), None)
        # The JSON size stands for the memory held: what a client controls (its input, the answer it asked for)
        # is what grows, and orjson measures it in C at a fraction of the call's own serialising.
        kept.size = len(orjson.dumps(kept.conversation)) + len(orjson.dumps(response))
        if kept.size > self.memory_bytes:
            return  # would evict everything else; read back from its record instead
        self.forget(response["id"])
        self._kept[response["id"]] = kept
        self.kept_bytes += kept.size
        while self.kept_bytes > self.memory_bytes:
            _, oldest = self._kept.popitem(last=False)
            self.kept_bytes -= oldest.size

    def forget(self, response_id: str) -> None:
        """Drop a response from memory (its record remains)."""
        kept = self._kept.pop(response_id, None)
        if kept is not None:
            self.kept_bytes -= kept.size

    async def find(self, response_id: str, owner: str | None, runs: frozenset[str] | None) -> _Kept | None:
        """A stored response by id, if `owner` (Auth.tenant of the caller's key) bound to `runs` (None: any) may see
        it: memory first, then the record (polled briefly: it may still be on its way). Another tenant's response is
        None, as an unknown id."""
        kept = await self._find(response_id)
        if kept is None or (owner is not None and kept.owner != owner):
            return None
        if runs is not None and kept.run is not None and kept.run not in runs:
            return None
        return kept

    async def _find(self, response_id: str) -> _Kept | None:
        kept = self._kept.get(response_id)
        if kept is not None:
            return kept
        match = RESPONSE_ID_RE.match(response_id)
        if match is None or self.engine is None:
            return None
        deadline = time.monotonic() + self.wait_s
        while True:
            unavailable = False
            try:
                exchange = await asyncio.wait_for(
                    asyncio.to_thread(recorded_exchange, self.engine, f"req-{match[1]}"), _READ_TIMEOUT_S
                )
            except (TimeoutError, SQLAlchemyError):
                exchange, unavailable = None, True
            except LookupError:  # a broken message chain: the request cannot be rebuilt
                exchange = None
            if exchange is not None:
                return _from_record(response_id, exchange)
            if time.monotonic() >= deadline:
                if unavailable:  # not "not found": the client may retry once the database is back
                    raise GatewayError(503, "database unavailable; retry later", "server_error", "database_unavailable")
                return None
            await asyncio.sleep(_POLL_S)

    async def create(self, scope: Scope, receive: Receive, send: Send, prefix: PathPrefix | None) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            # The key first: an unauthenticated caller learns nothing about its body.
            key, key_group, key_trajectory = split_api_key(presented_key(headers))
            runs = self.proxy.auth.check_agent(key)
            owner = self.proxy.auth.tenant(key)
            body = await self.proxy.read_body(receive, headers)  # the same body limit as every model call
            request = parse_json(body)
            previous = None
            if request.get("previous_response_id") is not None:
                previous = await self._previous(request["previous_response_id"], owner, runs)
            chat = chat_request(request, previous)
            if owner is not None:
                chat[EXTRA][OWNER] = owner
            size = _chat_size(chat)
        except GatewayError as exc:
            self.proxy.metrics.count_request(ENDPOINT, exc.status)
            await _send_json(send, exc.status, exc.body())
            return
        # The response id is the request id: 128 random bits, where other calls' ids are a counter.
        hex_id = secrets.token_hex(16)
        caller = Caller(
            "req-" + hex_id, ENDPOINT, CHAT, time.perf_counter(), time.time(), headers, prefix, key_group,
            key_trajectory, runs, size,
        )  # fmt: skip
        answer = _Answer(self, chat, "resp_" + hex_id, request.get("previous_response_id"), send)
        await self.proxy.serve(chat, caller, receive, answer)

    async def _previous(self, response_id: Any, owner: str | None, runs: frozenset[str] | None) -> list[dict[str, Any]]:
        if not isinstance(response_id, str):
            raise _bad("previous_response_id: expected a string")
        kept = await self.find(response_id, owner, runs)
        if kept is None:
            raise GatewayError(
                404, f"Previous response with id '{response_id[:80]}' not found.", code="previous_response_not_found"
            )
        return kept.conversation


def _from_record(response_id: str, exchange: RecordedExchange) -> _Kept | None:
    chat = exchange.request or {}
    if exchange.endpoint != ENDPOINT or exchange.status_code != 200 or exchange.response is None:
        return None
    if chat.get("store") is False:
        return None
    response = response_object(response_id, chat, exchange.response)
    return _Kept(continuation(chat, response), response, owner_of(chat), exchange.run)


def _chat_size(chat: dict[str, Any]) -> int:
    """The chat request's size as JSON, which the chat path holds to the body limit (it is what is recorded; a
    continuation carries the whole conversation); a 400 for one it could neither forward nor record: what a parsed
    body can fail on is nesting depth (orjson writes at most 254 levels)."""
    try:
        return len(orjson.dumps(chat))
    except orjson.JSONEncodeError:
        raise GatewayError(400, "request body is nested too deeply to forward", code="invalid_json") from None


async def _send_json(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class _Answer:
    """The call's `Answer` (gateway/proxy/exchange.py): a chat answer becomes a Response object, a chat stream
    Responses events (`_EventStream`); an error (already OpenAI-shaped, as Responses errors are) passes through."""

    def __init__(
        self, api: ResponsesAPI, chat: dict[str, Any], response_id: str, previous_id: str | None, send: Send
    ) -> None:
        # The request's facts live once, in the stream; a whole answer reads them from there too.
        self.stream = _EventStream(api, chat, response_id, previous_id, send)

    async def error(self, error: GatewayError, headers: Headers) -> None:
        headers = [(b"content-type", b"application/json"), *headers]
        await send_bytes(self.stream.send, error.status, error.body(), headers)

    async def answer(self, response: dict[str, Any], content_type: bytes, headers: Headers) -> None:
        s = self.stream
        shown = response_object(s.response_id, s.chat, response, previous_response_id=s.previous_id)
        s.api.remember(s.chat, shown)
        await send_bytes(s.send, 200, orjson.dumps(shown), [(b"content-type", content_type), *headers])

    async def passthrough(self, status: int, body: bytes, content_type: bytes, headers: Headers) -> None:
        # (a 200 that is not JSON too: recorded as such by the proxy, the client sees what vLLM sent)
        await send_bytes(self.stream.send, status, body, [(b"content-type", content_type), *headers])

    async def start(self, headers: Headers) -> None:
        await sse.start_stream(self.stream.send, headers)

    def chunk(self, chunk: dict[str, Any]) -> None:
        self.stream.chunk(chunk)

    def error_chunk(self, chunk: dict[str, Any], payload: bytes) -> None:
        self.stream.chunk(chunk)  # told as a failed response

    def done(self) -> None:
        self.stream.done()

    async def flush(self) -> None:
        await self.stream.flush()

    async def broke(self, message: str) -> None:
        await self.stream.broke(message)

    async def end(self) -> None:
        await self.stream.end()


class _EventStream:
    """Chat chunks in, Responses SSE events out, one output item at a time as the model writes it; the final
    Response (in `response.completed`) is built from the assembled chat answer, as `GET` rebuilds it. A read's
    chunks are translated when it is flushed, so a read that fails gives the client nothing of its own."""

    def __init__(
        self, api: ResponsesAPI, chat: dict[str, Any], response_id: str, previous_id: str | None, send: Send
    ) -> None:
        self.api = api
        self.chat = chat
        self.response_id = response_id
        self.previous_id = previous_id
        self.hex_id = response_id.removeprefix("resp_")
        self.send = send
        self.assembler = capture.StreamAssembler(CHAT)
        self.sequence = 0
        self.started = False
        self.finished = False
        self._pending: list[dict[str, Any] | None] = []  # the chunks of the read not flushed yet; None: [DONE]
        self.output_index = -1
        self.open: dict[str, Any] | None = None  # the output item being written
        self.tool_items: dict[int, dict[str, Any]] = {}

    def chunk(self, chunk: dict[str, Any]) -> None:
        """One chunk of the chat stream (vLLM's error event too), translated at the next `flush`."""
        self._pending.append(chunk)

    def done(self) -> None:
        """The chat stream's `[DONE]`."""
        self._pending.append(None)

    async def flush(self) -> None:
        out: list[bytes] = []
        for chunk in self._pending:
            self._on_chunk(chunk, out)
        self._pending.clear()
        await self._body(out, more=True)

    async def broke(self, message: str) -> None:
        self._pending.clear()
        out: list[bytes] = []
        if not self.finished:
            self._failed(message, out)
        await self._body(out, more=True)

    async def end(self) -> None:
        out: list[bytes] = []
        if not self.finished and self.started:
            self._failed("the stream ended before the model finished", out)
        await self._body(out, more=False)

    async def _body(self, out: list[bytes], more: bool) -> None:
        if out or not more:
            await self.send({"type": "http.response.body", "body": b"".join(out), "more_body": more})

    def _event(self, kind: str, out: list[bytes], **fields: Any) -> None:
        payload = orjson.dumps({"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1
        out.append(sse.frame(payload, event=kind))

    def _start(self, created: int | None, out: list[bytes]) -> None:
        self.started = True
        shell = response_object(self.response_id, self.chat, None, previous_response_id=self.previous_id)
        if created:
            shell["created_at"] = created
        self._event("response.created", out, response=shell)
        self._event("response.in_progress", out, response=shell)

    def _on_chunk(self, chunk: dict[str, Any] | None, out: list[bytes]) -> None:
        if self.finished:
            return
        if chunk is None:
            self._complete(out)
            return
        if not self.started:
            self._start(chunk.get("created"), out)
        if "error" in chunk and "choices" not in chunk:
            self._failed(str((chunk["error"] or {}).get("message", "upstream error")), out)
            return
        self.assembler.feed(chunk)
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                self._reasoning(reasoning, out)
            if delta.get("content"):
                logprobs = (choice.get("logprobs") or {}).get("content")
                self._text(delta["content"], logprobs if self.chat.get("logprobs") else None, out)
            for call in delta.get("tool_calls") or ():
                self._tool_call(call, out)

    def _open_item(self, item: dict[str, Any], out: list[bytes]) -> None:
        self._close(out)
        self.output_index += 1
        item["output_index"] = self.output_index
        self.open = item
        shown = {k: v for k, v in item.items() if k not in ("output_index", "text", "logprobs")}
        self._event("response.output_item.added", out, output_index=self.output_index, item=shown)

    def _reasoning(self, text: str, out: list[bytes]) -> None:
        if self.open is None or self.open["type"] != "reasoning":
            item = {"type": "reasoning", "id": f"rs_{self.hex_id}", "summary": [], "status": "in_progress", "text": ""}
            self._open_item(item, out)
            part = {"type": "reasoning_text", "text": ""}
            self._event("response.content_part.added", out, item_id=item["id"], output_index=self.output_index,
                        content_index=0, part=part)  # fmt: skip
        assert self.open is not None
        self.open["text"] += text
        self._event("response.reasoning_text.delta", out, item_id=self.open["id"], output_index=self.output_index,
                    content_index=0, delta=text)  # fmt: skip

    def _text(self, text: str, logprobs: list[dict[str, Any]] | None, out: list[bytes]) -> None:
        if self.open is None or self.open["type"] != "message":
            item = {"type": "message", "id": f"msg_{self.hex_id}", "role": "assistant", "status": "in_progress",
                    "content": [], "text": "", "logprobs": []}  # fmt: skip
            self._open_item(item, out)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._event("response.content_part.added", out, item_id=item["id"], output_index=self.output_index,
                        content_index=0, part=part)  # fmt: skip
        assert self.open is not None
        self.open["text"] += text
        shown = _output_logprobs(logprobs)
        self.open["logprobs"] += shown
        self._event("response.output_text.delta", out, item_id=self.open["id"], output_index=self.output_index,
                    content_index=0, delta=text, logprobs=shown)  # fmt: skip

    def _tool_call(self, call: dict[str, Any], out: list[bytes]) -> None:
        index = call.get("index", 0)
        function = call.get("function") or {}
        item = self.tool_items.get(index)
        if item is None:
            n = len(self.tool_items)
            known = {"call_id": call.get("id") or f"call_{self.hex_id}_{n}", "name": function.get("name") or "",
                     "arguments": ""}  # fmt: skip
            item = _tool_call_item(known, f"{self.hex_id}_{n}", self.chat.get(EXTRA) or {})
            if item["type"] == "function_call":
                item["status"] = "in_progress"
            item["text"] = ""  # the arguments as written so far
            self.tool_items[index] = item
            self._open_item(item, out)
        elif function.get("name"):
            item["name"] += function["name"]
        if function.get("arguments"):
            item["text"] += function["arguments"]
            # A custom tool's input is sent whole when its call ends (its shim's JSON must be decoded first); vLLM
            # too sends it only as far as it decodes.
            if item["type"] == "function_call":
                item["arguments"] = item["text"]
                self._event("response.function_call_arguments.delta", out, item_id=item["id"],
                            output_index=item["output_index"], delta=function["arguments"])  # fmt: skip

    def _close(self, out: list[bytes], final: list[dict[str, Any]] | None = None) -> None:
        """Finish the open item; `final` is the completed response's output, whose item the last one ends as."""
        item, self.open = self.open, None
        if item is None:
            return
        at = {"item_id": item["id"], "output_index": item["output_index"]}
        if item["type"] == "message":
            part: dict[str, Any] = {"type": "output_text", "text": item["text"], "annotations": []}
            if self.chat.get("logprobs"):
                part["logprobs"] = item["logprobs"]
            self._event("response.output_text.done", out, **at, content_index=0, text=item["text"],
                        logprobs=item["logprobs"])  # fmt: skip
            self._event("response.content_part.done", out, **at, content_index=0, part=part)
            done = {"type": "message", "id": item["id"], "role": "assistant", "status": "completed", "content": [part]}
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": item["text"]}
            self._event("response.reasoning_text.done", out, **at, content_index=0, text=item["text"])
            self._event("response.content_part.done", out, **at, content_index=0, part=part)
            done = {"type": "reasoning", "id": item["id"], "summary": [], "status": "completed", "content": [part]}
        elif item["type"] == "custom_tool_call":
            text = custom_input(item["text"]) if item["text"] else ""
            if text:
                self._event("response.custom_tool_call_input.delta", out, **at, delta=text)
            self._event("response.custom_tool_call_input.done", out, **at, input=text)
            done = {k: v for k, v in item.items() if k not in ("output_index", "text")} | {"input": text}
        else:
            self._event("response.function_call_arguments.done", out, **at, name=item["name"],
                        arguments=item["arguments"])  # fmt: skip
            done = {k: v for k, v in item.items() if k not in ("output_index", "text")} | {"status": "completed"}
        if final is not None and item["output_index"] < len(final):
            done = final[item["output_index"]]
        self._event("response.output_item.done", out, output_index=item["output_index"], item=done)

    def _complete(self, out: list[bytes]) -> None:
        if not self.started:
            self._start(None, out)
        self.finished = True
        answer = self.assembler.response()
        response = response_object(self.response_id, self.chat, answer, previous_response_id=self.previous_id)
        self._close(out, response["output"])
        self.api.remember(self.chat, response)
        # vLLM's endpoint ends every finished stream so, an incomplete one too (its status says so); Codex takes a
        # `response.incomplete` event for a failure.
        self._event("response.completed", out, response=response)

    def _failed(self, message: str, out: list[bytes]) -> None:
        if not self.started:
            self._start(None, out)
        self.finished = True
        self._event("error", out, code="server_error", message=message, param=None)
        response = response_object(
            self.response_id, self.chat, None, status="failed", previous_response_id=self.previous_id
        )
        response["error"] = {"code": "server_error", "message": message}
        self._event("response.failed", out, response=response)


# -- GET /v1/responses/{id} ------------------------------------------------------------------------------------------

router = APIRouter(dependencies=[Depends(require_agent)])


@router.get("/v1/responses/{response_id}")
async def retrieve(response_id: str, request: Request) -> Response:
    """A stored response, rebuilt from its record when this process no longer holds it; 404 in OpenAI's shape for an
    unknown id, one created with `store: false`, or one another agent key created."""
    gw = gateway_state(request)
    owner = gw.auth.tenant(split_api_key(presented_key(dict(request.headers)))[0])
    kept = await gw.responses.find(response_id, owner, agent_runs(request))
    if kept is None:
        raise GatewayError(404, f"No response found with id '{response_id[:80]}'.", code="not_found")
    return json_response(kept.response)
