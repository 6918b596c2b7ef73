"""The judge prompt: a group's shared context once, then each trajectory's turns labelled by id, the rubric and the
answer format; kept within a character budget by cutting the middle out of tool outputs first, then of the
longest messages.

Pure functions over the read views of `gateway.store.reads.trajectory_view` (calls with `messages`,
`completion`, `tool_calls`): no database, no HTTP, no model.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_RUBRIC = """\
- A trajectory that achieves the task's goal scores higher than one that does not; one that makes partial
  progress scores higher than one that makes none.
- Judge the final answer first: is it correct, complete and does it follow the task's instructions (format,
  length, language)? Facts the agent invented, or claims its tool results do not support, are errors.
- Then judge the way there: sensible tool calls with valid arguments, tool results actually used, no loops or
  wasted steps. Between two equally good answers, prefer the one that got there more directly.
- Use the whole range: 1.0 for a flawless trajectory, 0.0 for no useful progress or a harmful answer. Score each
  trajectory on its own merits, but make the scores rank the trajectories consistently against each other."""

# What a cut looks like inside a message; the judge is told not to hold it against the agent.
MARKER = "…[truncated {n} chars]…"
# No text is cut below this many characters (its head and tail stay readable around the marker).
MIN_KEEP = 120
# Room left in the budget for one corrective follow-up after a malformed answer (see `gateway.judge.core`).
RETRY_RESERVE = 1_500
# An explanation is one line; the schema caps it so a small model cannot ramble into max_tokens.
EXPLANATION_MAX_CHARS = 120


class PromptTooLong(ValueError):
    """Even with every text cut to its minimum the prompt exceeds max_context_chars."""


@dataclass(slots=True)
class Entry:
    """One rendered piece of a transcript: a `[label]` line and a body that may be truncated."""

    label: str
    text: str
    tool_output: bool = False
    body: str = ""  # what is rendered: the text, or the text with its middle cut out
    removed: int = 0  # characters of the text the cut removed (the number its marker shows)

    def __post_init__(self) -> None:
        self.body = self.text

    def cap(self, limit: int) -> None:
        """Render at most `limit` characters of the text (always cut from the whole text, never twice)."""
        if len(self.text) > limit:
            self.body, self.removed = cut_middle(self.text, limit)


@dataclass(slots=True)
class TrajectoryTranscript:
    trajectory_id: str
    entries: list[Entry]
    calls: int


@dataclass(slots=True)
class Truncation:
    """What was cut to fit the budget; stored with the rewards and returned by the API."""

    truncated: bool = False
    tool_outputs_truncated: int = 0
    messages_truncated: int = 0
    chars_removed: int = 0
    prompt_chars: int = 0
    max_context_chars: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class JudgePrompt:
    trajectory_ids: list[str]
    system: str
    user: str
    truncation: Truncation
    shared_entries: int  # how many leading entries all trajectories share (rendered once)
    schema: dict[str, Any] = field(default_factory=dict)

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system}, {"role": "user", "content": self.user}]

    @property
    def chars(self) -> int:
        return len(self.system) + len(self.user)


# ---------------------------------------------------------------------------------------------------------------
# From recorded calls to transcripts


def content_text(content: Any) -> str:
    """A message's content as text: multimodal parts are flattened, images named."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict):
                kind = part.get("type")
                if kind in ("text", "input_text", "output_text") or "text" in part:
                    parts.append(str(part.get("text", "")))
                else:
                    parts.append(f"[{kind or 'part'}]")
            else:
                parts.append(str(part))
        return "\n".join(parts)
    return json.dumps(content, ensure_ascii=False)


def _tool_call_text(call: Any) -> tuple[str, str]:
    """(name, arguments) of an OpenAI tool call."""
    if not isinstance(call, dict):
        return "tool", str(call)
    function = call.get("function") or {}
    name = str(function.get("name") or call.get("name") or "tool")
    arguments = function.get("arguments", call.get("arguments", ""))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return name, arguments


def _message_entries(message: Any) -> list[Entry]:
    if not isinstance(message, dict):
        return [Entry("message", content_text(message))]
    role = str(message.get("role") or "message")
    text = content_text(message.get("content"))
    if role in ("tool", "function"):
        name = message.get("name") or message.get("tool_call_id")
        return [Entry(f"tool result{f' ({name})' if name else ''}", text, tool_output=True)]
    entries = []
    if text or not message.get("tool_calls"):
        entries.append(Entry(role, text))
    for call in message.get("tool_calls") or []:
        name, arguments = _tool_call_text(call)
        entries.append(Entry(f"{role} calls tool {name}", arguments))
    return entries


def _call_messages(call: dict[str, Any]) -> list[Any]:
    """The request's messages; a completions prompt counts as one message."""
    messages = call.get("messages")
    if call.get("endpoint") == "completions" or not isinstance(messages, list):
        return [] if messages is None else [{"role": "prompt", "content": content_text(messages)}]
    return messages


def _completion_message(call: dict[str, Any]) -> dict[str, Any] | None:
    """What the model answered, as an assistant message; a failed call as a note."""
    if call.get("completion") is None and not call.get("tool_calls"):
        status = call.get("status_code")
        if status not in (None, 200) or call.get("error"):
            error = str(call.get("error") or "")[:300]
            return {"role": "call failed", "content": f"status {status}: {error}".strip()}
        return None
    role = "completion" if call.get("endpoint") == "completions" else "assistant"
    return {"role": role, "content": call.get("completion"), "tool_calls": call.get("tool_calls")}


def first_messages(trajectory: dict[str, Any]) -> list[Any]:
    calls = [c for c in trajectory.get("calls") or [] if c.get("choice_index", 0) == 0]
    return _call_messages(calls[0]) if calls else []


def conversation(trajectory: dict[str, Any]) -> list[Any]:
    """The trajectory as one message list: the first request's messages, then whatever each later request adds,
    and the model's answers in between.

    An agent that keeps its history sends, each turn, the previous request's messages plus the reply it got (which
    it may have edited) plus new messages (tool results, a new user turn); only what is new is added. A request that
    does not extend the previous one (a new context: a sub-agent, a summarised history) is shown whole after a
    note. Only the first choice of an n > 1 call is followed.
    """
    out: list[Any] = []
    previous: list[Any] | None = None
    pending: dict[str, Any] | None = None
    for call in trajectory.get("calls") or []:
        if call.get("choice_index", 0) != 0:
            continue
        messages = _call_messages(call)
        if previous is not None and messages[: len(previous)] == previous:
            new = messages[len(previous) :]
            # The agent echoes the reply it got as an assistant message: show that one instead of ours.
            echoed = bool(new) and isinstance(new[0], dict) and new[0].get("role") == "assistant"
            if pending is not None and not echoed:
                out.append(pending)
        else:
            if pending is not None:
                out.append(pending)
            if previous is not None:
                out.append({"role": "note", "content": "the agent's next request starts a new context:"})
            new = messages
        out.extend(new)
        pending = _completion_message(call)
        previous = messages
    if pending is not None:
        out.append(pending)
    return out


def shared_prefix(trajectories: Sequence[dict[str, Any]]) -> list[Any]:
    """The leading messages every trajectory's first request has in common (system prompt, task)."""
    firsts = [first_messages(t) for t in trajectories]
    if not firsts:
        return []
    prefix: list[Any] = []
    for column in zip(*firsts):
        if any(message != column[0] for message in column[1:]):
            break
        prefix.append(column[0])
    return prefix


def transcripts(trajectories: Sequence[dict[str, Any]]) -> tuple[list[Entry], list[TrajectoryTranscript]]:
    """(shared context entries, one transcript per trajectory without the shared part)."""
    prefix = shared_prefix(trajectories)
    shared = [entry for message in prefix for entry in _message_entries(message)]
    out = []
    for trajectory in trajectories:
        messages = conversation(trajectory)[len(prefix) :]
        entries = [entry for message in messages for entry in _message_entries(message)]
        # The last thing the assistant said is the trajectory's answer: say so, judges look for it.
        for entry in reversed(entries):
            if entry.label in ("assistant", "completion"):
                entry.label += ", final answer"
                break
        calls = len({c.get("seq") for c in trajectory.get("calls") or []})
        out.append(TrajectoryTranscript(str(trajectory["trajectory_id"]), entries, calls))
    return shared, out


# ---------------------------------------------------------------------------------------------------------------
# Rendering


def answer_schema(ids: Sequence[str]) -> dict[str, Any]:
    """JSON schema of the answer. `prefixItems` with a `const` id per position lets a guided decoder (vLLM) produce
    every id exactly once, in order; providers that only take it as a hint still get the shape."""
    def item(trajectory_id: str) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {
                "trajectory_id": {"type": "string", "const": trajectory_id},
                "score": {"type": "number", "minimum": 0, "maximum": 1},
                "explanation": {"type": "string", "minLength": 1, "maxLength": EXPLANATION_MAX_CHARS},
            },
            "required": ["trajectory_id", "score", "explanation"],
            "additionalProperties": False,
        }

    return {
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "prefixItems": [item(i) for i in ids],
                "items": False,
                "minItems": len(ids),
                "maxItems": len(ids),
            }
        },
        "required": ["scores"],
        "additionalProperties": False,
    }


def _quoted(ids: Sequence[str]) -> str:
    return ", ".join(f'"{i}"' for i in ids)


def system_prompt(ids: Sequence[str], rubric: str | None) -> str:
    return (
        f"You are an impartial judge of an AI agent. The agent attempted the same task {len(ids)} time(s); each "
        "attempt is a trajectory with an id. Read the shared context (given identically to every attempt), then "
        "each trajectory's turns, and score every trajectory from 0 to 1 by the rubric. Text shown as "
        f"{MARKER.format(n='N')} was shortened for length: do not hold the cut against the agent.\n\n"
        f"Rubric:\n{(rubric or DEFAULT_RUBRIC).strip()}\n\n"
        "Answer with JSON only, no other text, in this form:\n"
        '{"scores": [{"trajectory_id": "<id>", "score": <number from 0 to 1>, '
        '"explanation": "<one sentence: why this score>"}, ...]}\n'
        f"with exactly one entry for each trajectory id, in this order: {_quoted(ids)}."
    )


def _render_entries(entries: Sequence[Entry]) -> str:
    return "\n".join(f"[{entry.label}]\n{entry.body}" for entry in entries)


def user_prompt(shared: Sequence[Entry], items: Sequence[TrajectoryTranscript]) -> str:
    parts = []
    if shared:
        parts.append("# Shared context (the start of every trajectory)\n" + _render_entries(shared))
    for item in items:
        header = f'# Trajectory "{item.trajectory_id}" ({item.calls} model call{"s" if item.calls != 1 else ""})'
        body = _render_entries(item.entries) if item.entries else "(nothing beyond the shared context)"
        parts.append(f"{header}\n{body}")
    ids = [item.trajectory_id for item in items]
    parts.append(f"Score each of the {len(ids)} trajectories: {_quoted(ids)}. Answer with the JSON only.")
    return "\n\n".join(parts)


# ---------------------------------------------------------------------------------------------------------------
# Fitting the budget


def cut_middle(text: str, limit: int) -> tuple[str, int]:
    """(`text` cut to at most `limit` characters by replacing its middle with a marker, characters removed)."""
    if len(text) <= limit:
        return text, 0
    removed = len(text) - limit
    for _ in range(3):  # the marker's length depends on the number it shows
        keep = max(0, limit - len(MARKER.format(n=removed)))
        removed = len(text) - keep
    head = (keep + 1) // 2
    tail = keep - head
    return text[:head] + MARKER.format(n=removed) + (text[len(text) - tail :] if tail else ""), removed


def truncate_middle(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters by removing its middle, which a marker replaces."""
    return cut_middle(text, limit)[0]


def _water_level(lengths: Sequence[int], excess: int, floor: int) -> int | None:
    """The largest cap C >= floor with sum(max(0, L - C)) >= excess, or None if even `floor` is not enough."""
    if sum(max(0, n - floor) for n in lengths) < excess:
        return None
    low, high = floor, max(lengths, default=floor)
    while low < high:
        mid = (low + high + 1) // 2
        if sum(max(0, n - mid) for n in lengths) >= excess:
            low = mid
        else:
            high = mid - 1
    return low


def _fit(entries: list[Entry], overhead: int, budget: int) -> None:
    """Cut bodies in place until overhead + bodies <= budget: tool outputs first, then any text, longest first."""
    for tools_only in (True, False):
        total = overhead + sum(len(e.body) for e in entries)
        if total <= budget:
            return
        pool = [e for e in entries if e.tool_output or not tools_only]
        level = _water_level([len(e.body) for e in pool], total - budget, MIN_KEEP)
        cap = MIN_KEEP if level is None else level
        for entry in pool:
            if len(entry.body) > cap:
                entry.cap(cap)


def build_prompt(
    trajectories: Sequence[dict[str, Any]], rubric: str | None = None, max_context_chars: int = 32_000
) -> JudgePrompt:
    """The judge prompt for a group's trajectories (views from `trajectory_view`), at most `max_context_chars`
    characters (system + user) minus the room kept for one corrective retry. Raises PromptTooLong."""
    ids = [str(t["trajectory_id"]) for t in trajectories]
    shared, items = transcripts(trajectories)
    system = system_prompt(ids, rubric)
    entries = shared + [entry for item in items for entry in item.entries]
    budget = max_context_chars - RETRY_RESERVE
    # Rendering is concatenation: its length is a fixed overhead plus the bodies' lengths.
    for entry in entries:
        entry.body = ""
    overhead = len(system) + len(user_prompt(shared, items))
    for entry in entries:
        entry.body = entry.text
    _fit(entries, overhead, budget)
    user = user_prompt(shared, items)
    chars = len(system) + len(user)
    if chars > budget:
        raise PromptTooLong(
            f"the judge prompt for {len(ids)} trajectories needs {chars + RETRY_RESERVE} characters even with "
            f"every text cut to {MIN_KEEP}; raise max_context_chars (now {max_context_chars})"
        )
    cut = [e for e in entries if e.removed]
    truncation = Truncation(
        truncated=bool(cut),
        tool_outputs_truncated=sum(1 for e in cut if e.tool_output),
        messages_truncated=sum(1 for e in cut if not e.tool_output),
        chars_removed=sum(e.removed for e in cut),
        prompt_chars=chars,
        max_context_chars=max_context_chars,
    )
    return JudgePrompt(ids, system, user, truncation, len(shared), answer_schema(ids))
