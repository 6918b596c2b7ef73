"""The OpenAI SDK `responses.create` calls the Responses fixtures were recorded with; the fast tests replay them.

A plain question (with instructions), and a function-call loop: turn 1 asks for the weather with the repo's in-context
tool example (SmolLM2's template ignores `tools`), turn 2 sends the function's output, either by
`previous_response_id` or by resending every item as the OpenAI Agents SDK does without it. Both forms must reach vLLM
as the same chat request, so one recording answers either.
"""

from __future__ import annotations

from typing import Any

import openai

from scripts.record_fixtures import TOOL_EXAMPLE, TOOL_SYSTEM, WEATHER_QUESTION, WEATHER_RESULT, WEATHER_TOOL

RUN = "responses-agent"
TOKEN_IN_RUN = "responses-tokenin"
QUESTION = "What is the capital of France?"
INSTRUCTIONS = "Answer in one sentence."
FUNCTION_TOOL = {"type": "function", "name": WEATHER_TOOL["function"]["name"],
                 "description": WEATHER_TOOL["function"]["description"],
                 "parameters": WEATHER_TOOL["function"]["parameters"]}  # fmt: skip
# The tool example as input items; its system message becomes the instructions.
TOOL_ITEMS: list[dict[str, Any]] = [
    *({"role": m["role"], "content": m["content"]} for m in TOOL_EXAMPLE[1:]),
    {"role": "user", "content": WEATHER_QUESTION},
]
assert TOOL_EXAMPLE[0]["content"] == TOOL_SYSTEM


def ask(client: openai.OpenAI, stream: bool, run: str = RUN, **extra: Any) -> Any:
    """The plain question: the Response (non-stream) or the list of stream events."""
    answer = client.responses.create(
        model=run, input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=24, temperature=0, stream=stream,
        **extra,
    )  # fmt: skip
    return list(answer) if stream else answer


def _create(client: openai.OpenAI, stream: bool, **kwargs: Any) -> tuple[Any, list[Any]]:
    """(the final Response, the stream events or [])."""
    if not stream:
        return client.responses.create(**kwargs), []
    events = list(client.responses.create(stream=True, **kwargs))
    final = [e for e in events if e.type in ("response.completed", "response.incomplete")]
    assert final, [e.type for e in events]
    return final[-1].response, events


def tool_loop(
    client: openai.OpenAI, stream: bool, by_previous_id: bool, run: str = RUN
) -> list[tuple[Any, list[Any]]]:
    """Two turns: the weather question, then the function's output (for whatever call the model made, or a
    placeholder call id if it made none, so turn 2 runs whatever it chose). Returns (Response, events) per turn."""
    common: dict[str, Any] = {
        "model": run, "instructions": TOOL_SYSTEM, "tools": [FUNCTION_TOOL], "max_output_tokens": 48, "temperature": 0,
    }  # fmt: skip
    first, first_events = _create(client, stream, input=TOOL_ITEMS, **common)
    calls = [item for item in first.output if item.type == "function_call"]
    output = {"type": "function_call_output", "call_id": calls[0].call_id if calls else "call-0",
              "output": WEATHER_RESULT}  # fmt: skip
    if by_previous_id:
        second = _create(client, stream, input=[output], previous_response_id=first.id, **common)
    else:
        history = [*TOOL_ITEMS, *(item.model_dump(exclude_none=True) for item in first.output), output]
        second = _create(client, stream, input=history, **common)
    return [(first, first_events), second]
