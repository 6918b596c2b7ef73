"""A bench-only vLLM stand-in for long tool conversations: chat completions and the scale-out endpoints token_in uses
(render, generate, derender), non-stream, over a deterministic toy tokenizer, in the exact JSON shapes recorded from
vLLM 0.32 CPU (tests/fixtures/vllm/conversation_turn2_tool_call.json, scale_out_{render,generate,derender}_tools.json:
each answer is the recorded body with its ids, logprobs, message and usage replaced).

What is synthetic: the tokenizer (one id per space-separated word, special ids for ChatML markup), the template
(ChatML like SmolLM2's, which renders an assistant message that carries `tool_calls` with its content only, dropping
the call, so chat mode shows the real merge break) and the "model": after a user message it calls `get_weather`
with a long query, after a tool result it answers in text, `--completion-words` words either way, logprobs a fixed
function of the id. SmolLM2 itself has an 8k context, too short for the 64-turn (~30k token) conversation measured.

    python bench/token_upstream.py --port 8102 [--completion-words 150]
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import uuid
from pathlib import Path
from typing import Any

from aiohttp import web

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from gateway.proxy.token_in import usage  # noqa: E402

FIXTURES = REPO_ROOT / "tests" / "fixtures" / "vllm"
MODEL = "smollm2"
IM_START, IM_END, NL, TOOL_OPEN, TOOL_CLOSE = 1, 2, 198, 10, 11
SPECIAL = {
    IM_START: "<|im_start|>",
    IM_END: "<|im_end|>",
    NL: "\n",
    TOOL_OPEN: "<tool_call>",
    TOOL_CLOSE: "</tool_call>",
}
WORDS = [f"{a}{b}" for a in ("ka", "lo", "mi", "ner", "pu", "sa", "ti", "vo") for b in ("ba", "den", "go", "ro", "sh")]


class Toy:
    """The tokenizer, template and model; ids are handed out per distinct word, the same for the whole process."""

    def __init__(self, completion_words: int) -> None:
        self.completion_words = completion_words
        self.ids: dict[str, int] = {}
        self.pieces: dict[int, str] = dict(SPECIAL)
        templates = {
            name: json.loads((FIXTURES / f"{name}.json").read_text())["response"]
            for name in (
                "conversation_turn2_tool_call",
                "scale_out_render_tools",
                "scale_out_generate_tools",
                "scale_out_derender_tools",
            )
        }
        self.chat_template = templates["conversation_turn2_tool_call"]
        self.render_template = templates["scale_out_render_tools"]
        self.generate_template = templates["scale_out_generate_tools"]
        self.derender_template = templates["scale_out_derender_tools"]
        self.models = json.loads((FIXTURES / "models.json").read_text())["response"]

    # -- tokenizer and template --------------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        out = []
        for word in text.split(" ") if text else ():
            if word not in self.ids:
                self.ids[word] = 1000 + len(self.ids)
                self.pieces[self.ids[word]] = word
            out.append(self.ids[word])
        return out

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.pieces[i] for i in ids)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """ChatML; an assistant message's tool_calls are not rendered (SmolLM2's template drops them)."""
        ids: list[int] = []
        for message in messages:
            content = message.get("content") or ""
            if isinstance(content, list):
                content = "".join(part.get("text", "") for part in content)
            ids += [IM_START, *self.encode(message["role"]), NL, *self.encode(content), IM_END, NL]
        if add_generation_prompt:
            ids += [IM_START, *self.encode("assistant"), NL]
        return ids

    # -- the model ---------------------------------------------------------------------------------------------------

    def generate(self, prompt: list[int]) -> list[int]:
        """A tool call after a user message, a text answer after a tool result; ends with <|im_end|>."""
        starts = [i for i, token in enumerate(prompt) if token == IM_START]
        last_role = self.pieces[prompt[starts[-2] + 1]] if len(starts) >= 2 else "user"
        rng = random.Random(len(prompt))
        words = " ".join(rng.choice(WORDS) for _ in range(self.completion_words))
        if last_role == "tool":
            return [*self.encode(words), IM_END]
        call = json.dumps({"name": "get_weather", "arguments": {"city": "Paris", "query": words}})
        return [TOOL_OPEN, NL, *self.encode(call), NL, TOOL_CLOSE, IM_END]

    def message(self, completion: list[int]) -> tuple[dict[str, Any], str]:
        """The parsed assistant message (hermes-style tool call parsing) and its finish reason."""
        body = completion[:-1] if completion and completion[-1] == IM_END else completion
        if body[:1] == [TOOL_OPEN]:
            call = json.loads(self.decode(body[2:-2]))
            arguments = json.dumps(call["arguments"], ensure_ascii=False)
            tool_call = {"id": uuid.uuid4().hex[:16], "type": "function",
                         "function": {"name": call["name"], "arguments": arguments}}  # fmt: skip
            return {"role": "assistant", "content": None, "tool_calls": [tool_call]}, "tool_calls"
        return {"role": "assistant", "content": self.decode(body), "tool_calls": []}, "stop"

    @staticmethod
    def logprob(token: int) -> float:
        return -0.05 - (token % 13) / 20


def _sampling(template: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    params = dict(template["sampling_params"])
    for key in ("temperature", "max_tokens", "top_p", "top_k", "min_p"):
        if body.get(key) is not None:
            params[key] = body[key]
    return params


def make_app(toy: Toy) -> web.Application:
    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        prompt = toy.render(body["messages"])
        completion = toy.generate(prompt)
        message, finish = toy.message(completion)
        out = copy.deepcopy(toy.chat_template)
        choice = out["choices"][0]
        choice["message"] = {**choice["message"], **message}
        choice["finish_reason"] = finish
        choice["token_ids"] = completion
        choice["logprobs"] = {"content": [_chat_logprob(toy, token) for token in completion]}
        out["prompt_token_ids"] = prompt
        out["id"] = f"chatcmpl-{uuid.uuid4().hex[:16]}"
        out["usage"] = usage(len(prompt), len(completion))
        return web.json_response(out)

    async def render(request: web.Request) -> web.Response:
        body = await request.json()
        out = copy.deepcopy(toy.render_template)
        out["token_ids"] = toy.render(body["messages"], body.get("add_generation_prompt", True))
        out["sampling_params"] = _sampling(toy.render_template, body)
        return web.json_response(out)

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        completion = toy.generate(body["token_ids"])
        out = copy.deepcopy(toy.generate_template)
        choice = out["choices"][0]
        choice["token_ids"] = completion
        choice["finish_reason"] = "stop"
        choice["weight_versions"] = [{"version": "default", "start": 0, "end": len(completion)}]
        entries = []
        for token in completion:
            entry = {"token_id": token, "logprob": toy.logprob(token), "rank": 1}
            entries.append({**entry, "top_logprobs": [entry]})
        choice["logprobs"] = {"content": entries}
        out["usage"] = {**usage(len(body["token_ids"]), len(completion)), "completion_tokens_details": None}
        return web.json_response(out)

    async def derender(request: web.Request) -> web.Response:
        body = await request.json()
        choice_in = body["generate_response"]["choices"][0]
        completion = choice_in["token_ids"]
        message, _ = toy.message(completion)
        out = copy.deepcopy(toy.derender_template)
        choice = out["choices"][0]
        choice["message"] = {**choice["message"], **message}
        choice["finish_reason"] = "stop"  # derender says stop for a tool call too (the gateway reports tool_calls)
        choice["logprobs"] = {"content": [_chat_logprob(toy, token) for token in completion]}
        out["id"] = body["generate_response"].get("request_id") or out["id"]
        out["usage"] = usage(0, len(completion))
        return web.json_response(out)

    async def models(request: web.Request) -> web.Response:
        return web.json_response(toy.models)

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/chat/completions/render", render)
    app.router.add_post("/inference/v1/generate", generate)
    app.router.add_post("/v1/chat/completions/derender", derender)
    app.router.add_get("/v1/models", models)
    return app


def _chat_logprob(toy: Toy, token: int) -> dict[str, Any]:
    piece = toy.pieces[token]
    entry = {"token": piece, "logprob": toy.logprob(token), "bytes": list(piece.encode())}
    return {**entry, "top_logprobs": [entry]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--completion-words", type=int, default=150)
    args = parser.parse_args(argv)
    print(f"token_upstream listening on http://{args.host}:{args.port}/v1", flush=True)
    web.run_app(make_app(Toy(args.completion_words)), host=args.host, port=args.port, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
