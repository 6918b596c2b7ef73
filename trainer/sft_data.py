"""A supervised warm start from a file of chat conversations (``trajgate train --sft-data FILE``): each line one
``{"messages": [...], "tools": [...]?}`` in the OpenAI chat shape, rendered with the base model's own chat template,
trained on its assistant turns only.

Why the model's own template, applied as vLLM applies it: the run then samples through vLLM from exactly the prompt
the warm start trained after (same markup, same special tokens, same tokenisation: ``apply_chat_template`` to text,
then the tokenizer without added special tokens, as a chat request does). Messages reach the template as vLLM hands
them over: ``null`` content as ``""``, text parts joined, tool-call arguments parsed to objects.

Which tokens are the assistant's is found on token ids, never by searching the text (a template may render a role
name, a tool call or an end token any way it likes): for assistant turn ``i``,

- ``prompt_i = render(messages[:i], add_generation_prompt=True)`` is what vLLM would have sent the model;
- ``turn_i = render(messages[:i + 1])`` is the conversation with that answer in it;
- the trained span is ``turn_i`` past the longest common prefix of the two: the answer and whatever the template
  closes it with (its end token), which is what the model must produce to stop. Where a tokenizer merges the
  generation prompt's last characters with the answer's first ones, the span starts at the merged token.

Turns go into one row while each ``turn_i`` extends the row's ids; a template that rewrites earlier turns (one that
drops past reasoning, say) starts a new row at that turn, so every trained token is trained after exactly the
context the template gives it. The whole file is checked and rendered before the first step: a bad line is reported
with its number, and nothing trains.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from trainer.samples import Row

ROLES = ("system", "developer", "user", "assistant", "tool")
# Past this many bad lines the rest are not listed: the first few say what is wrong with the file.
MAX_REPORTED = 20


class SftDataError(ValueError):
    """The file cannot be trained on; the message lists each bad line as ``FILE:LINE: why``."""


class ChatTokenizer(Protocol):
    """What rendering needs of a transformers tokenizer."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...


@dataclass(frozen=True)
class Conversation:
    """One line of the file: its number (1-based), its messages as the template gets them, the tools, and which
    messages are trained (assistant turns whose ``weight`` is not 0)."""

    line: int
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    trained: tuple[int, ...]


@dataclass
class SftData:
    """The file's rows and what became of its conversations."""

    rows: list[Row]
    conversations: int
    truncated: int = 0  # rows cut at max_seq_len (their tokens past it are not trained)
    dropped: list[str] = field(default_factory=list)  # "line N: why" for conversations that yield no trained token

    @property
    def trained_tokens(self) -> int:
        return sum(row.trainable_tokens for row in self.rows)


# ---------------------------------------------------------------------------------------------
# Reading and checking the file
# ---------------------------------------------------------------------------------------------


def _content(value: Any, where: str) -> str:
    """A message's content as vLLM gives it to a template: None as "", text parts joined by newlines."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ValueError(f"{where}: content parts must be {{\"type\": \"text\", \"text\": ...}} (no images)")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(f"{where}: content must be a string, a list of text parts or null")


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant's tool calls, arguments parsed from their JSON string to an object (as vLLM does for templates)."""
    if not isinstance(value, list):
        raise ValueError(f"{where}: tool_calls must be a list")
    calls = []
    for n, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"{where}: tool_calls[{n}] needs function.name")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: tool_calls[{n}].function.arguments is not JSON ({exc.msg})") from None
        if not isinstance(arguments, dict):
            raise ValueError(f"{where}: tool_calls[{n}].function.arguments must be a JSON object")
        calls.append({**call, "type": call.get("type", "function"), "function": {**function, "arguments": arguments}})
    return calls


def _message(value: Any, index: int) -> tuple[dict[str, Any], bool]:
    """A message as the template gets it, and whether it is a trained assistant turn."""
    where = f"messages[{index}]"
    if not isinstance(value, dict):
        raise ValueError(f"{where} is not an object")
    role = value.get("role")
    if role not in ROLES:
        raise ValueError(f"{where}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
    out: dict[str, Any] = {"role": role, "content": _content(value.get("content"), where)}
    for key in ("name", "tool_call_id"):
        if isinstance(value.get(key), str):
            out[key] = value[key]
    weight = value.get("weight", 1)
    if weight not in (0, 1) or isinstance(weight, bool):
        raise ValueError(f"{where}: weight must be 0 or 1")
    if role != "assistant":
        if "weight" in value:
            raise ValueError(f"{where}: only assistant turns have a weight")
        return out, False
    if value.get("tool_calls"):
        out["tool_calls"] = _tool_calls(value["tool_calls"], where)
    reasoning = value.get("reasoning", value.get("reasoning_content"))
    if isinstance(reasoning, str):
        out["reasoning"] = out["reasoning_content"] = reasoning
    return out, weight == 1


def parse_line(text: str, line: int) -> Conversation:
    """One line of the file; raises ValueError saying what is wrong with it (without the line number)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list) or not data["messages"]:
        raise ValueError('expected an object {"messages": [...]} with at least one message')
    tools = data.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError("tools must be a list of objects")
    messages, trained = [], []
    for index, value in enumerate(data["messages"]):
        message, train = _message(value, index)
        messages.append(message)
        if train:
            trained.append(index)
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("no assistant turn: nothing to train")
    if not trained:
        raise ValueError("every assistant turn has weight 0: nothing to train")
    return Conversation(line=line, messages=messages, tools=tools or None, trained=tuple(trained))


def read_conversations(path: str | Path) -> list[Conversation]:
    """Every conversation of the file, checked; raises SftDataError listing the bad lines (blank lines are skipped)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise SftDataError(f"{path}: cannot read it ({exc})") from None
    conversations, errors = [], []
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            conversations.append(parse_line(text, number))
        except ValueError as exc:
            errors.append(f"{path}:{number}: {exc}")
    if errors:
        more = f"\n... and {len(errors) - MAX_REPORTED} more" if len(errors) > MAX_REPORTED else ""
        raise SftDataError(f"{len(errors)} bad line(s) in {path}:\n" + "\n".join(errors[:MAX_REPORTED]) + more)
    if not conversations:
        raise SftDataError(f"{path} holds no conversation")
    return conversations


# ---------------------------------------------------------------------------------------------
# Rendering: token ids and the assistant mask
# ---------------------------------------------------------------------------------------------


def render(
    tokenizer: ChatTokenizer,
    conversation: Conversation,
    upto: int,
    generation_prompt: bool,
    messages: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The ids of ``messages[:upto]`` (default the conversation's) as vLLM renders a chat request: the template to
    text, then tokenized without special tokens added (the template writes its own)."""
    text = tokenizer.apply_chat_template(
        (conversation.messages if messages is None else messages)[:upto],
        tools=conversation.tools,
        add_generation_prompt=generation_prompt,
        tokenize=False,
    )
    if not isinstance(text, str):
        raise TypeError(f"the chat template rendered {type(text).__name__}, not text")
    return list(tokenizer.encode(text, add_special_tokens=False))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def conversation_rows(tokenizer: ChatTokenizer, conversation: Conversation, index: int) -> list[Row]:
    """The training rows of one conversation (module docstring): one row unless the template rewrites history.

    Raises ValueError if the template fails on it, a trained turn renders to no tokens, or the template leaves out a
    trained turn's tool calls (vLLM would too: the row would teach the model to answer with nothing).
    """
    rows: list[tuple[list[int], list[tuple[int, int]]]] = []  # (ids, trained spans)
    for i in conversation.trained:
        prompt = render(tokenizer, conversation, i, True)
        turn = render(tokenizer, conversation, i + 1, False)
        start = _common_prefix(prompt, turn)
        if start >= len(turn):
            raise ValueError(f"assistant turn messages[{i}] renders to no tokens after its prompt")
        if conversation.messages[i].get("tool_calls"):
            bare = {k: v for k, v in conversation.messages[i].items() if k != "tool_calls"}
            without = [*conversation.messages[:i], bare]
            if render(tokenizer, conversation, i + 1, False, without) == turn:
                # SmolLM2's template, say: the model would be taught to answer a tool-calling turn with nothing.
                raise ValueError(
                    f"the chat template does not render the tool calls of messages[{i}]: write the call into the "
                    "turn's content in the model's own format, or give the turn weight 0"
                )
        if rows and turn[: len(rows[-1][0])] == rows[-1][0]:
            ids, spans = rows[-1]
            rows[-1] = (turn, [*spans, (max(start, len(ids)), len(turn))])
        else:
            rows.append((turn, [(start, len(turn))]))
    out: list[Row] = []
    for ids, spans in rows:
        mask = [0] * len(ids)
        for begin, end in spans:
            mask[begin:end] = [1] * (end - begin)
        mask[0] = 0  # nothing precedes the first token to predict it from
        out.append(
            Row(
                input_ids=ids,
                loss_mask=mask,
                behaviour_logprobs=[0.0] * len(ids),
                advantage=0.0,
                trajectory_id=f"line-{conversation.line}",
                group_id="sft-data",
                sequence_id=index + len(out),
            )
        )
    return out


def sft_data_rows(tokenizer: ChatTokenizer, conversations: Sequence[Conversation], max_seq_len: int) -> SftData:
    """Every conversation rendered to rows, cut at ``max_seq_len``; raises SftDataError listing the lines the
    template fails on. A conversation whose trained tokens all lie past ``max_seq_len`` is dropped (and listed)."""
    data = SftData(rows=[], conversations=len(conversations))
    errors = []
    for conversation in conversations:
        try:
            rows = conversation_rows(tokenizer, conversation, len(data.rows))
        except Exception as exc:  # the template's own error (a role order it refuses, say): the user's to fix
            errors.append(f"line {conversation.line}: the chat template fails on it: {type(exc).__name__}: {exc}")
            continue
        kept = 0
        for row in rows:
            if len(row) > max_seq_len:
                data.truncated += 1
                row = Row(
                    input_ids=row.input_ids[:max_seq_len],
                    loss_mask=row.loss_mask[:max_seq_len],
                    behaviour_logprobs=row.behaviour_logprobs[:max_seq_len],
                    advantage=row.advantage,
                    trajectory_id=row.trajectory_id,
                    group_id=row.group_id,
                    sequence_id=len(data.rows),
                )
            if row.trainable_tokens:
                data.rows.append(row)
                kept += 1
        if not kept:
            data.dropped.append(f"line {conversation.line}: no assistant token within max_seq_len ({max_seq_len})")
    if errors:
        more = f"\n... and {len(errors) - MAX_REPORTED} more" if len(errors) > MAX_REPORTED else ""
        listed = "\n".join(errors[:MAX_REPORTED])
        raise SftDataError(f"{len(errors)} conversation(s) cannot be rendered:\n{listed}{more}")
    if not data.rows:
        raise SftDataError("no conversation has an assistant token within max_seq_len: " + "; ".join(data.dropped[:5]))
    return data


# ---------------------------------------------------------------------------------------------
# The steps
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SftStep:
    """One optimizer step of the warm start: its rows, and the epoch (1-based) they come from."""

    epoch: int
    rows: list[Row]


def plan_steps(
    rows: Sequence[Row], batch_rows: int, epochs: int | None = None, steps: int | None = None, seed: int = 0
) -> list[SftStep]:
    """The warm start's steps: each epoch the rows in a seeded shuffled order, ``batch_rows`` per step (an epoch's
    last step takes what is left). ``steps`` alone runs that many steps (as many epochs as it takes); with
    ``epochs`` too it stops at whichever comes first; neither is one epoch."""
    if batch_rows < 1:
        raise ValueError("batch_rows must be at least 1")
    if epochs is not None and epochs < 1:
        raise ValueError("epochs must be at least 1")
    if steps is not None and steps < 1:
        raise ValueError("steps must be at least 1")
    if not rows:
        raise ValueError("no rows to train")
    per_epoch = math.ceil(len(rows) / batch_rows)
    if epochs is None:
        epochs = 1 if steps is None else math.ceil(steps / per_epoch)
    plan: list[SftStep] = []
    for epoch in range(1, epochs + 1):
        order = list(rows)
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        plan.extend(SftStep(epoch, order[start : start + batch_rows]) for start in range(0, len(order), batch_rows))
    return plan if steps is None else plan[:steps]
