"""Which chat templates token_in may continue exactly, and their end tokens: known before any call ends.

token_in splices the model's exact completion ids into the template's tokens for the next turn. That is only right
if the gateway knows (1) every token a generation can end on (a completion that ended on one is closed; one cut by
max_tokens gets the template's closing token) and (2) that the template's turns can be continued this way at all.
Neither may be guessed from what generations happen to do, and every gateway must decide alike, so both come from
the template itself:

- the gateway renders a fixed probe conversation once per served model (vLLM's render endpoint), without and with
  a tool offered, and hashes the ids: the *fingerprint* names tokenizer + template (its tool prompt included),
  whatever the model weights or served name;
- the fingerprint is looked up in the registry of templates the qualification suite passed
  (`gateway/proxy/qualified_templates.json`, written by `scripts/qualify_token_in.py`), which holds the model's end
  tokens
  (its `generation_config.json` `eos_token_id` list and the tokenizer's eos) and the tokens the template closes an
  assistant turn with;
- a template that is not there is refused (`template_not_qualified`) unless the operator vouches for it with an
  entry of their own in `TRAJGATE_TOKEN_IN_TEMPLATES` (a JSON file of the same shape).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

REGISTRY = Path(__file__).with_name("qualified_templates.json")

# The conversation whose renders fingerprint a template: the roles every template renders (a tool message is not
# one: Gemma 3's template refuses it), rendered once as it is and once with PROBE_TOOL offered.
PROBE_MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "trajgate probe: system"},
    {"role": "user", "content": "trajgate probe: user"},
    {"role": "assistant", "content": "trajgate probe: assistant"},
    {"role": "user", "content": "trajgate probe: user again"},
]


PROBE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "trajgate_probe",
        "description": "trajgate probe: tool",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
    },
}


@dataclass(frozen=True, slots=True)
class TemplateInfo:
    """What token_in needs to know of one template + tokenizer."""

    name: str
    # Every token a generation can stop on (vLLM stops on all of them).
    end_token_ids: frozenset[int]
    # The tokens the template ends an assistant turn with in a history: the end tokens, plus any the model never
    # generates there (harmony's `<|end|>` after a final answer, where generation stopped on `<|return|>`).
    turn_end_ids: frozenset[int]


def probe_bodies(model: str) -> list[dict[str, Any]]:
    """The render requests whose token ids fingerprint the template vLLM serves `model` with."""
    body = {"model": model, "messages": PROBE_MESSAGES, "add_generation_prompt": True}
    return [body, {**body, "tools": [PROBE_TOOL]}]


def fingerprint(renders: list[list[int] | None]) -> str:
    """A short stable name for the probes' renders (None: the template refused that probe)."""
    return hashlib.sha256(orjson.dumps(renders)).hexdigest()[:16]


def load_registry(extra: str | None = None) -> dict[str, TemplateInfo]:
    """The qualified templates by fingerprint, with the operator's own entries (a JSON file at `extra`) on top."""
    entries: dict[str, Any] = orjson.loads(REGISTRY.read_bytes())["templates"]
    if extra:
        entries = {**entries, **orjson.loads(Path(extra).read_bytes())["templates"]}
    return {key: template_info(entry) for key, entry in entries.items()}


def template_info(entry: dict[str, Any]) -> TemplateInfo:
    """One registry entry as the gateway uses it; raises ValueError for an entry without end tokens."""
    ends = frozenset(int(t) for t in entry.get("end_token_ids") or ())
    if not ends:
        raise ValueError(f"template entry {entry.get('name')!r} lists no end_token_ids")
    turn_ends = ends | frozenset(int(t) for t in entry.get("turn_end_ids") or ())
    return TemplateInfo(str(entry.get("name") or "?"), ends, turn_ends)


def end_token_ids(
    generation_config: dict[str, Any], tokenizer_config: dict[str, Any], vocab: dict[str, int]
) -> list[int]:
    """A model's end tokens from its files: generation_config.json's `eos_token_id` (one id or a list) and the
    tokenizer's `eos_token` (a string or an AddedToken dict), looked up in `vocab` (tokenizer.json's added tokens)."""
    ids: list[int] = []
    eos = generation_config.get("eos_token_id")
    for token in eos if isinstance(eos, list) else [eos]:
        if isinstance(token, int) and token not in ids:
            ids.append(token)
    name = tokenizer_config.get("eos_token")
    if isinstance(name, dict):
        name = name.get("content")
    if isinstance(name, str) and name in vocab and vocab[name] not in ids:
        ids.append(vocab[name])
    return ids
