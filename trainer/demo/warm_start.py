"""The demo's supervised warm start (`trajgate demo --sft-rounds N`): rejection-sampling fine-tuning on the base
model's own best episodes, then GRPO.

The base model plays N rounds of the task through the gateway in a run of its own (`demo-collect`: recorded like
any run, admission off, nothing trains it); the episodes whose reward is at least `--sft-min-reward` become chat
conversations in the file `trajgate train --sft-data` reads, and that trains them as the demo run's first steps. The
run's GRPO steps then start from the warm-started adapter. Everything goes through what a user has: the example
agent's `collect` mode, the export's records, `--sft-data`.

Each assistant turn is the text the model produced (its completion ids decoded, the end token off), not the message
the agent got back: vLLM's tool parser turns a hermes `<tool_call>` into `tool_calls`, and SmolLM2's chat template
renders no `tool_calls` at all, so the parsed message would train an empty turn. The text renders back into the
tokens that were sampled. The conversation is rebuilt from the trajectory's calls in turn order: the first call's
messages, then for each call its answer and the messages the agent added before the next call (the tool results).
Only the model's answers are trained: assistant turns the agent wrote itself (the tool demo's two worked episodes in
its prompt) are context, weight 0.
A trajectory whose calls do not extend one another that way (a branch, an agent that rewrote its history) is skipped
and counted. The export holds no `tools`; SmolLM2's template ignores them, so the file carries none.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Decode = Callable[[Sequence[int]], str]


@dataclass(frozen=True)
class Selection:
    """What the warm start kept of the collected episodes, for the demo's report."""

    episodes: int  # collected training episodes with a reward
    selected: int  # of those, reward at least the threshold
    skipped: int  # selected, but not one linear conversation
    conversations: list[dict[str, Any]]


def conversation_of(trajectory: dict[str, Any], decode: Decode) -> dict[str, Any] | None:
    """One `--sft-data` line (`{"messages": [...]}`) from an exported trajectory, or None if its calls are not one
    conversation that each call extends."""
    calls = sorted((c for c in trajectory["calls"] if c["choice_index"] == 0), key=lambda c: c["seq"])
    if not calls or any(not isinstance(c["messages"], list) or c["completion_token_ids"] is None for c in calls):
        return None
    messages: list[dict[str, Any]] = context(calls[0]["messages"])
    for previous, call in zip([None, *calls], calls):
        if previous is not None:
            sent = call["messages"]
            known = len(previous["messages"]) + 1  # what the previous call was sent, and its answer
            roles = [m.get("role") for m in sent[:known]]
            if len(sent) <= known or roles != [*(m.get("role") for m in previous["messages"]), "assistant"]:
                return None
            messages.extend(context(sent[known:]))
        messages.append({"role": "assistant", "content": decode(call["completion_token_ids"])})
    return {"messages": messages}


def context(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages the agent wrote, as context only: an assistant turn among them (a worked example in the prompt, say)
    gets weight 0, so only what the model itself produced is trained."""
    return [{**m, "weight": 0} if m.get("role") == "assistant" else m for m in messages]


def select_conversations(trajectories: Iterable[dict[str, Any]], min_reward: float, decode: Decode) -> Selection:
    """The conversations of the episodes that earned at least `min_reward`, oldest first."""
    episodes = selected = skipped = 0
    conversations: list[dict[str, Any]] = []
    for trajectory in trajectories:
        if trajectory["reward"] is None:
            continue
        episodes += 1
        if trajectory["reward"] < min_reward:
            continue
        selected += 1
        conversation = conversation_of(trajectory, decode)
        if conversation is None:
            skipped += 1
        else:
            conversations.append(conversation)
    return Selection(episodes, selected, skipped, conversations)


def text_decoder(weights: Path) -> Decode:
    """Completion ids to the text the model wrote, special tokens kept (they are part of what it wrote) but the end
    token it stopped on dropped: the chat template closes the turn with its own."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(weights))
    ends = {tokenizer.eos_token_id} - {None}

    def decode(ids: Sequence[int]) -> str:
        ids = list(ids)
        while ids and ids[-1] in ends:
            ids.pop()
        return str(tokenizer.decode(ids, skip_special_tokens=False))

    return decode


def write_conversations(conversations: Sequence[dict[str, Any]], path: Path) -> Path:
    path.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in conversations))
    return path
