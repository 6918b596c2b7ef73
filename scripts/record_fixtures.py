"""Record what a real vLLM answers to the requests the gateway sends upstream.

The fake upstream in the fast tests replays these files, so it can only be as faithful as they are:
every request here is shaped the way the gateway forwards it (chat: `"logprobs": true`, completions:
`"logprobs": 0`, always `"return_token_ids": true`), sampling is greedy or seeded so a re-record
gives the same tokens, and streams are kept as the raw SSE payloads in arrival order.

One JSON file per scenario in tests/fixtures/vllm/<name>.json:

    {
      "name": str,                       # also the file name
      "method": "POST" | "GET",
      "path": "/v1/chat/completions",    # path on the vLLM server
      "request": {...} | null,           # the body exactly as sent (null for GET)
      "status": int,                     # HTTP status vLLM answered
      "headers": {"content-type": str | null},
      "stream": bool,                    # true when the answer was an SSE stream
      "response": <parsed JSON body, or the raw text if not JSON> | null,  # null for streams
      "raw_body": str | null,            # the body text byte-for-byte; null for streams
      "chunks": [str, ...] | null,       # each SSE `data:` payload as received; last "[DONE]"
      "vllm_version": str
    }

Multi-turn scenarios (conversation_*) build each request from the previous answers the way an
OpenAI SDK agent does: the assistant message is echoed back with its content and tool_calls.

Run from the repo root: `python scripts/record_fixtures.py` (starts SmolLM2 via trainer.demo.vllm_cpu)
or `python scripts/record_fixtures.py --base-url http://127.0.0.1:PORT/v1` for a running server.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from trainer.demo.vllm_cpu import smollm2_server  # noqa: E402

MODEL = "smollm2"
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "vllm"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
TOOL_SYSTEM = (
    "You are a helpful assistant. Use the get_weather tool for any question about weather."
)
# SmolLM2's chat template does not render `tools`, so the 135M model never calls one unprompted; one
# worked example in the history (hermes markup, as the parser expects) makes it call get_weather.
TOOL_EXAMPLE = [
    {"role": "system", "content": TOOL_SYSTEM},
    {"role": "user", "content": "What is the weather in London?"},
    {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "London"}}\n'
        "</tool_call>",
    },
]
WEATHER_QUESTION = "What is the weather in Paris?"
WEATHER_RESULT = json.dumps({"city": "Paris", "temperature": 18, "unit": "celsius", "sky": "sunny"})


def chat(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """A chat body as the gateway forwards it: logprobs and token ids on, greedy by default."""
    return {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 24,
        "temperature": 0,
        "logprobs": True,
        "return_token_ids": True,
        **extra,
    }


def completion(prompt: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 16,
        "temperature": 0,
        "logprobs": 0,
        "return_token_ids": True,
        **extra,
    }


class Recorder:
    def __init__(self, base_url: str, out_dir: Path) -> None:
        self.base_url = base_url.rstrip("/")
        self.root_url = self.base_url.removesuffix("/v1")
        self.out_dir = out_dir
        self.vllm_version = json.loads(self._raw("GET", "/version", None)[2])["version"]
        self.recorded: dict[str, dict[str, Any]] = {}

    def _request(
        self, method: str, path: str, body: dict[str, Any] | None
    ) -> urllib.request.Request:
        return urllib.request.Request(
            f"{self.root_url}{path}",
            data=None if body is None else json.dumps(body).encode(),
            headers={} if body is None else {"Content-Type": "application/json"},
            method=method,
        )

    def _raw(self, method: str, path: str, body: dict[str, Any] | None) -> tuple[int, Any, str]:
        try:
            with urllib.request.urlopen(self._request(method, path, body), timeout=300) as response:
                return response.status, response.headers, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.headers, error.read().decode()

    def record(
        self, name: str, method: str, path: str, body: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        started = time.monotonic()
        stream = bool(body and body.get("stream"))
        fixture: dict[str, Any] = {
            "name": name,
            "method": method,
            "path": path,
            "request": body,
        }
        if stream:
            status, headers, chunks = self._stream(path, body)
            fixture.update(status=status, headers={"content-type": headers.get("content-type")})
            if isinstance(chunks, str):  # an error answered as a plain body, not as SSE
                fixture.update(
                    stream=False, response=_parse(headers, chunks), raw_body=chunks, chunks=None
                )
            else:
                fixture.update(stream=True, response=None, raw_body=None, chunks=chunks)
        else:
            status, headers, text = self._raw(method, path, body)
            fixture.update(
                status=status,
                headers={"content-type": headers.get("content-type")},
                stream=False,
                response=_parse(headers, text),
                raw_body=text,
                chunks=None,
            )
        fixture["vllm_version"] = self.vllm_version
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"{name}.json").write_text(json.dumps(fixture, indent=1) + "\n")
        self.recorded[name] = fixture
        print(f"{name}: {fixture['status']} in {time.monotonic() - started:.1f}s", flush=True)
        return fixture

    def _stream(self, path: str, body: dict[str, Any] | None) -> tuple[int, Any, list[str] | str]:
        try:
            response = urllib.request.urlopen(self._request("POST", path, body), timeout=300)
        except urllib.error.HTTPError as error:
            return error.code, error.headers, error.read().decode()
        with response:
            if not (response.headers.get("content-type") or "").startswith("text/event-stream"):
                return response.status, response.headers, response.read().decode()
            chunks: list[str] = []
            for raw_line in response:
                line = raw_line.decode().rstrip("\r\n")
                if not line:
                    continue
                if not line.startswith("data: "):
                    raise ValueError(f"unexpected SSE line from vLLM: {line!r}")
                chunks.append(line[len("data: ") :])
            return response.status, response.headers, chunks


def _parse(headers: Any, text: str) -> Any:
    if "json" in (headers.get("content-type") or ""):
        return json.loads(text)
    return text


def assistant_message(fixture: dict[str, Any]) -> dict[str, Any]:
    """Echo an answer back the way the OpenAI SDK serialises it into the next request."""
    message = fixture["response"]["choices"][0]["message"]
    echoed: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        echoed["tool_calls"] = [
            {"id": call["id"], "type": call["type"], "function": call["function"]}
            for call in message["tool_calls"]
        ]
    return echoed


def record_conversation(rec: Recorder) -> None:
    """Three turns of an agent that sends its tools every time, with a tool round-trip in turn 2."""
    messages: list[dict[str, Any]] = [
        *TOOL_EXAMPLE,
        {"role": "user", "content": "Hello, I am Ada. How are you?"},
    ]
    path = "/v1/chat/completions"
    turn1 = rec.record("conversation_turn1", "POST", path, chat(messages, tools=[WEATHER_TOOL]))
    messages += [assistant_message(turn1), {"role": "user", "content": WEATHER_QUESTION}]
    call = rec.record(
        "conversation_turn2_tool_call",
        "POST",
        path,
        chat(messages, tools=[WEATHER_TOOL], max_tokens=48),
    )
    tool_calls = call["response"]["choices"][0]["message"].get("tool_calls")
    if not tool_calls:
        raise RuntimeError("SmolLM2 did not call get_weather in turn 2; the conversation needs it")
    messages += [
        assistant_message(call),
        {"role": "tool", "tool_call_id": tool_calls[0]["id"], "content": WEATHER_RESULT},
    ]
    result = rec.record(
        "conversation_turn2_tool_result", "POST", path, chat(messages, tools=[WEATHER_TOOL])
    )
    messages += [assistant_message(result), {"role": "user", "content": "Thanks! What is my name?"}]
    rec.record("conversation_turn3", "POST", path, chat(messages, tools=[WEATHER_TOOL]))


SUPERVISOR_SYSTEM = "You are a supervisor. You delegate research to a researcher, then give the final answer."
RESEARCHER_SYSTEM = "You are a researcher. Answer the question you are given with facts."
TREE_QUESTION = "What is the capital of Italy?"


def record_tree(rec: Recorder) -> None:
    """The shapes of a non-linear trajectory (gateway.store.tree), each call greedy and in the order an agent sends
    them: a supervisor that plans, a researcher sub-agent with its own system prompt (two turns), the supervisor
    resuming its own history with the report; then two parallel branches off the supervisor's first call; then the
    supervisor's history compacted into a summary."""
    path = "/v1/chat/completions"
    boss = [{"role": "system", "content": SUPERVISOR_SYSTEM},
            {"role": "user", "content": f"Question: {TREE_QUESTION} Say what to ask the researcher."}]  # fmt: skip
    plan = rec.record("tree_plan", "POST", path, chat(boss))
    helper = [{"role": "system", "content": RESEARCHER_SYSTEM}, {"role": "user", "content": TREE_QUESTION}]
    research = rec.record("tree_research", "POST", path, chat(helper))
    helper += [assistant_message(research), {"role": "user", "content": "Now say only the answer, in one word."}]
    report = rec.record("tree_report", "POST", path, chat(helper))
    said = report["response"]["choices"][0]["message"]["content"]
    resumed = [*boss, assistant_message(plan),
               {"role": "user", "content": f"The researcher reports: {said} Give the final answer in one word."}]  # fmt: skip
    rec.record("tree_conclude", "POST", path, chat(resumed))
    for name, check in (("tree_branch_a", "Which country is it about?"), ("tree_branch_b", "Is it a city?")):
        rec.record(name, "POST", path, chat([*boss, assistant_message(plan), {"role": "user", "content": check}]))
    compacted = [boss[0], {"role": "user", "content": f"Summary of our conversation so far: asked about {said}"},
                 {"role": "user", "content": "Give the final answer in one word."}]  # fmt: skip
    rec.record("tree_compacted", "POST", path, chat(compacted))


def record_tree_handoff(rec: Recorder) -> None:
    """The OpenAI Agents SDK handoff of examples/agents_sdk_handoff.py (triage hands the question to the geographer,
    who answers), driven through the gateway in front of a recording proxy once per token mode, as
    tests/support/handoff_agent.py replays it: eval mode, greedy."""
    from tests.support.handoff_agent import RUNS, play

    for mode, run in RUNS.items():
        with _recording_gateway(rec, run=run, token_mode=mode) as (gateway, proxy):
            play(gateway.url, mode, f"handoff-{mode}")
        name = f"tree_handoff_{mode}"
        fixture = {"name": name, "path": None, "exchanges": proxy.recorded, "vllm_version": rec.vllm_version}
        (rec.out_dir / f"{name}.json").write_text(json.dumps(fixture, indent=1) + "\n")
        rec.recorded[name] = fixture
        print(f"{name}: {[(e['path'], e['status']) for e in proxy.recorded]}", flush=True)


def record_scale_out(rec: Recorder) -> None:
    """vLLM's token-level endpoints (need `--enable-scale-out`): render a chat request to its exact prompt ids and
    sampling params, generate from ids, derender the generated ids into a ChatCompletion (tool parser applied), for
    a tool call and the tool-result turn that follows, non-stream and stream. Recorded for the token_in mode's fast
    tests. A stream derender is one request per generated chunk, each carrying the previous `stream_state`: those
    exchanges go into one file, `scale_out_derender_tools_stream.json`, as `exchanges` [{request, status, response}]."""
    messages = [*TOOL_EXAMPLE, {"role": "user", "content": WEATHER_QUESTION}]
    chat_request = {"model": MODEL, "messages": messages, "tools": [WEATHER_TOOL], "max_tokens": 48, "temperature": 0}
    render = rec.record("scale_out_render_tools", "POST", "/v1/chat/completions/render", chat_request)
    generate_body = {
        "model": MODEL,
        "token_ids": render["response"]["token_ids"],
        "sampling_params": {**render["response"]["sampling_params"], "logprobs": 0},
    }
    generated = rec.record("scale_out_generate_tools", "POST", "/inference/v1/generate", generate_body)
    derender_path = "/v1/chat/completions/derender"
    answer = rec.record(
        "scale_out_derender_tools",
        "POST",
        derender_path,
        {"model": MODEL, "chat_request": chat_request, "generate_response": generated["response"]},
    )
    stream = rec.record("scale_out_generate_tools_stream", "POST", "/inference/v1/generate", {**generate_body, "stream": True})
    exchanges: list[dict[str, Any]] = []
    state: Any = None
    for payload in stream["chunks"]:
        if payload == "[DONE]":
            continue
        body = {
            "model": MODEL,
            "chat_request": {**chat_request, "stream": True},
            "stream": True,
            "generate_chunk": json.loads(payload),
            "stream_state": state,
            # Refused without it when a tool parser is configured (it tells whether the prompt left reasoning open).
            "prompt_token_ids": generate_body["token_ids"],
        }
        status, headers, text = rec._raw("POST", derender_path, body)
        response = _parse(headers, text)
        exchanges.append({"request": body, "status": status, "response": response})
        state = response.get("stream_state") if isinstance(response, dict) else None
    fixture = {"name": "scale_out_derender_tools_stream", "method": "POST", "path": derender_path,
               "exchanges": exchanges, "vllm_version": rec.vllm_version}
    (rec.out_dir / "scale_out_derender_tools_stream.json").write_text(json.dumps(fixture, indent=1) + "\n")
    rec.recorded[fixture["name"]] = fixture
    print(f"scale_out_derender_tools_stream: {[e['status'] for e in exchanges]}", flush=True)

    tool_calls = answer["response"]["choices"][0]["message"].get("tool_calls")
    if not tool_calls:
        raise RuntimeError("SmolLM2 did not call get_weather; the tool-result turn needs it")
    follow_up = {
        **chat_request,
        "messages": [
            *messages,
            assistant_message(answer),
            {"role": "tool", "tool_call_id": tool_calls[0]["id"], "content": WEATHER_RESULT},
        ],
    }
    render = rec.record("scale_out_render_tool_result", "POST", "/v1/chat/completions/render", follow_up)
    generate_body = {
        "model": MODEL,
        "token_ids": render["response"]["token_ids"],
        "sampling_params": {**render["response"]["sampling_params"], "logprobs": 0},
    }
    generated = rec.record("scale_out_generate_tool_result", "POST", "/inference/v1/generate", generate_body)
    rec.record(
        "scale_out_derender_tool_result",
        "POST",
        derender_path,
        {"model": MODEL, "chat_request": follow_up, "generate_response": generated["response"]},
    )


def record_ui_token_text(rec: Recorder) -> None:
    """The trajectory page's one request for its tokens' text (gateway.ui.token_text), for the seeded trajectory whose
    completion ids are real SmolLM2 tokens (tests/support/ui_seed.py): vLLM's completions derender, tokenizer only."""
    from gateway.ui.token_text import DERENDER_COMPLETIONS, derender_body
    from tests.support.ui_seed import TOKEN_TEXT_IDS

    rec.record("ui_token_text", "POST", DERENDER_COMPLETIONS, derender_body(TOKEN_TEXT_IDS))


@contextlib.contextmanager
def _recording_gateway(
    rec: Recorder, run: str | None = None, token_mode: str = "token_in"
) -> Iterator[tuple[Any, Any]]:
    """A gateway on a scratch SQLite with a run in `token_mode` (token_in's agent run unless named), whose upstream
    is a FakeUpstream forwarding to the real vLLM and recording every exchange (in `proxy.recorded` once the block
    ends)."""
    import tempfile

    import httpx

    from tests.support.fake_upstream import FakeUpstream
    from tests.support.gateway_harness import running_gateway
    from tests.support.token_in_agent import RUN

    proxy = FakeUpstream(fixtures={}, forward_to=rec.root_url).start()
    try:
        with tempfile.TemporaryDirectory() as tmp, running_gateway(
            database_url=f"sqlite:///{tmp}/trajgate.db",
            upstream_url=proxy.base_url,
            base_model=MODEL,
            spool_dir=f"{tmp}/spool",
        ) as gateway:
            config = {"name": run or RUN, "config": {"token_mode": token_mode}}
            httpx.post(gateway.url + "/v1/runs", json=config, timeout=30).raise_for_status()
            yield gateway, proxy
    finally:
        proxy.stop()


def record_token_in(rec: Recorder) -> None:
    """The gateway's own token_in exchanges (render twice, generate, derender; streamed and not) for the tool loop in
    tests/support/token_in_agent.py, recorded by running the real gateway in front of a recording proxy to this vLLM. The
    loop runs in eval mode so the client's greedy sampling reaches vLLM and a re-record gives the same tokens; the
    proxy holds each generate chunk until the gateway derendered the previous one (tests/support/fake_upstream.py lockstep),
    the same one-chunk-per-derender sequence the fast tests replay."""
    import openai

    from tests.support.token_in_agent import tool_loop

    for stream in (False, True):
        with _recording_gateway(rec) as (gateway, proxy):
            client = openai.OpenAI(base_url=f"{gateway.url}/eval/t/recorded/v1", api_key="x", max_retries=0)
            tool_loop(client, stream)
        name = "token_in_tool_loop_stream" if stream else "token_in_tool_loop"
        fixture = {"name": name, "path": None, "exchanges": proxy.recorded, "vllm_version": rec.vllm_version}
        (rec.out_dir / f"{name}.json").write_text(json.dumps(fixture, indent=1) + "\n")
        rec.recorded[name] = fixture
        print(f"{name}: {[(e['path'], e['status']) for e in proxy.recorded]}", flush=True)


# token_in calls whose answers the fast tests compare with chat mode's: logprobs (with and without top_logprobs) and n.
TOKEN_IN_PROMPT = [{"role": "user", "content": "Say hi in French."}]
TOKEN_IN_LOGPROBS = [{"logprobs": True, "top_logprobs": 2}, {"logprobs": True}]
TOKEN_IN_N = {"n": 2, "temperature": 0.8, "seed": 1, "max_tokens": 8}


# A reply that ends at once: the end of turn (SmolLM2's <|im_end|>, id 2) forced as the first token.
TOKEN_IN_EMPTY = [{"max_tokens": 8, "temperature": 0, "logit_bias": {"2": 100}, **extra} for extra in ({}, {"logprobs": True})]


def record_token_in_calls(rec: Recorder) -> None:
    """token_in calls with `logprobs`/`top_logprobs`, with `n: 2`, and whose reply ends at once, each streamed and not,
    recorded through the gateway like the tool loop; beside the first and the last, chat mode's answers to the same
    greedy requests, straight from vLLM, which the gateway's must equal."""
    import uuid

    import openai

    from tests.support.token_in_agent import RUN

    for name, calls, compared in (
        ("token_in_logprobs", [{"max_tokens": 24, "temperature": 0, **extra} for extra in TOKEN_IN_LOGPROBS], True),
        ("token_in_n", [TOKEN_IN_N], False),
        ("token_in_empty", TOKEN_IN_EMPTY, True),
    ):
        reference = [json.loads(rec._raw("POST", "/v1/chat/completions", chat(TOKEN_IN_PROMPT, **extra))[2])
                     for extra in calls] if compared else None
        with _recording_gateway(rec) as (gateway, proxy):
            for stream in (False, True):
                for extra in calls:
                    url = f"{gateway.url}/eval/t/{name}-{uuid.uuid4().hex[:8]}/v1"
                    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
                    answer = client.chat.completions.create(
                        model=RUN, messages=TOKEN_IN_PROMPT, stream=stream, **extra
                    )
                    if stream:
                        list(answer)
        fixture: dict[str, Any] = {"name": name, "path": None, "exchanges": proxy.recorded}
        if reference is not None:
            fixture["chat_reference"] = reference
        fixture["vllm_version"] = rec.vllm_version
        (rec.out_dir / f"{name}.json").write_text(json.dumps(fixture, indent=1) + "\n")
        rec.recorded[name] = fixture
        print(f"{name}: {[(e['path'], e['status']) for e in proxy.recorded]}", flush=True)


def record_responses(rec: Recorder) -> None:
    """The OpenAI Responses API calls of tests/support/responses_agent.py (a question, and the function-call loop continued by
    `previous_response_id`), streamed and not, driven through the gateway (which translates them to chat) in front of
    a recording proxy: once for a chat-mode run, once for a token_in run. Eval mode, so greedy sampling reaches vLLM."""
    import uuid

    import openai

    from tests.support.responses_agent import RUN as RESPONSES_RUN
    from tests.support.responses_agent import TOKEN_IN_RUN, ask, tool_loop

    for name, run in (("responses_chat", RESPONSES_RUN), ("responses_token_in", TOKEN_IN_RUN)):
        with _recording_gateway(rec, run=TOKEN_IN_RUN) as (gateway, proxy):
            for stream in (False, True):
                def client() -> openai.OpenAI:
                    url = f"{gateway.url}/eval/t/{name}-{uuid.uuid4().hex[:8]}/v1"
                    return openai.OpenAI(base_url=url, api_key="x", max_retries=0)

                ask(client(), stream, run)
                tool_loop(client(), stream, by_previous_id=True, run=run)
            ask(client(), False, run, store=False)
            for stream in (False, True):  # output-text logprobs, as an SDK asks for them
                ask(client(), stream, run, include=["message.output_text.logprobs"], top_logprobs=2)
        fixture = {"name": name, "path": None, "exchanges": proxy.recorded, "vllm_version": rec.vllm_version}
        (rec.out_dir / f"{name}.json").write_text(json.dumps(fixture, indent=1) + "\n")
        rec.recorded[name] = fixture
        print(f"{name}: {[(e['path'], e['status']) for e in proxy.recorded]}", flush=True)


def record_messages(rec: Recorder) -> None:
    """The gateway's own chat exchanges for Anthropic Messages API calls (tests/support/messages_agent.py's tool loop,
    streamed and not, in both token modes; a stop-sequence call; count_tokens' render), recorded like token_in's:
    the real gateway drives them through a recording proxy to this vLLM, in eval mode so the client's greedy
    sampling reaches vLLM and a re-record gives the same tokens."""
    import anthropic

    from tests.support.messages_agent import COUNT_TOKENS, RUN, STOP_CALL, tool_loop

    for token_mode in ("chat", "token_in"):
        for stream in (False, True):
            with _recording_gateway(rec, RUN, token_mode) as (gateway, proxy):
                url = f"{gateway.url}/eval/t/recorded-{token_mode}-{int(stream)}"
                client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
                tool_loop(client, stream)
                if token_mode == "chat" and not stream:
                    client.messages.create(**STOP_CALL)
                    client.messages.count_tokens(**COUNT_TOKENS)
            name = f"messages_{token_mode}_tool_loop" + ("_stream" if stream else "")
            fixture = {"name": name, "path": None, "exchanges": proxy.recorded, "vllm_version": rec.vllm_version}
            (rec.out_dir / f"{name}.json").write_text(json.dumps(fixture, indent=1) + "\n")
            rec.recorded[name] = fixture
            print(f"{name}: {[(e['path'], e['status']) for e in proxy.recorded]}", flush=True)


def record_all(rec: Recorder) -> None:
    path = "/v1/chat/completions"
    question = [
        {"role": "user", "content": "What is the capital of France? Answer in one sentence."}
    ]
    weather = [*TOOL_EXAMPLE, {"role": "user", "content": WEATHER_QUESTION}]
    include_usage = {"stream_options": {"include_usage": True}}

    rec.record("chat", "POST", path, chat(question))
    rec.record("chat_stream", "POST", path, chat(question, stream=True, **include_usage))
    rec.record("chat_top_logprobs", "POST", path, chat(question, top_logprobs=2))
    # An open-ended prompt, so the seeded samples of one group differ (a factual one gives twins).
    poem = [{"role": "user", "content": "Write a short poem about the sea."}]
    rec.record(
        "chat_n2_seeded", "POST", path, chat(poem, n=2, temperature=0.8, seed=1234, max_tokens=16)
    )
    tools = {"tools": [WEATHER_TOOL], "tool_choice": "auto", "max_tokens": 48}
    rec.record("chat_tools", "POST", path, chat(weather, **tools))
    rec.record(
        "chat_tools_stream", "POST", path, chat(weather, stream=True, **include_usage, **tools)
    )
    record_conversation(rec)
    record_scale_out(rec)
    record_token_in(rec)
    record_token_in_calls(rec)
    record_responses(rec)
    record_messages(rec)
    record_tree(rec)
    record_tree_handoff(rec)
    record_ui_token_text(rec)
    record_teacher(rec)
    rec.record("completions", "POST", "/v1/completions", completion("The capital of France is"))
    rec.record(
        "completions_stream",
        "POST",
        "/v1/completions",
        completion("The capital of France is", stream=True, **include_usage),
    )
    rec.record("error_n2_temperature0", "POST", path, chat(question, n=2, temperature=0))
    rec.record("error_stream_options_without_stream", "POST", path, chat(question, **include_usage))
    rec.record("models", "GET", "/v1/models")
    rec.record(
        "load_lora_adapter_bad_path",
        "POST",
        "/v1/load_lora_adapter",
        {"lora_name": "missing@1", "lora_path": "/nonexistent/trajgate/adapter"},
    )


def record_teacher(rec: Recorder) -> None:
    """On-policy distillation's teacher request (trainer/teacher.py): the full id sequences of two recorded calls
    (prompt + completion) scored by `prompt_logprobs: 0`, one token generated (vLLM refuses `max_tokens: 0`, recorded
    too). Two prompts answered here, but vLLM 0.32 CPU with --enable-lora kills its engine when prompt_logprobs requests
    share an engine step (three prompts did, and so may two: the client sends one per request), see trainer/teacher.py."""
    sequences = []
    for name in ("chat", "chat_n2_seeded"):
        answer = json.loads((rec.out_dir / f"{name}.json").read_text())["response"]
        sequences.append(answer["prompt_token_ids"] + answer["choices"][0]["token_ids"])
    body = {
        "model": MODEL, "prompt": sequences, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0,
        "return_token_ids": True,
    }  # fmt: skip
    rec.record("teacher_prompt_logprobs", "POST", "/v1/completions", body)
    rec.record("error_teacher_max_tokens_0", "POST", "/v1/completions", {**body, "max_tokens": 0})


def _stream_facts(chunks: list[str]) -> str:
    events = [json.loads(c) for c in chunks if c != "[DONE]"]
    # Chat puts prompt_token_ids at the top level, completions in each choice.
    with_prompt = [
        i
        for i, e in enumerate(events)
        if e.get("prompt_token_ids") or any(c.get("prompt_token_ids") for c in e.get("choices", []))
    ]
    empty_delta_with_ids = [
        i
        for i, e in enumerate(events)
        for choice in e.get("choices", [])
        if choice.get("delta") == {} and choice.get("token_ids")
    ]
    fingerprint = [i for i, e in enumerate(events) if e.get("system_fingerprint")]
    return (
        f"{len(events)} events; prompt_token_ids in {with_prompt}; "
        f"empty delta with token_ids in {empty_delta_with_ids}; system_fingerprint in {fingerprint}"
    )


def _extends(previous: dict[str, Any], following: dict[str, Any]) -> bool:
    before = (
        previous["response"]["prompt_token_ids"] + previous["response"]["choices"][0]["token_ids"]
    )
    return bool(following["response"]["prompt_token_ids"][: len(before)] == before)


def summarise(recorded: dict[str, dict[str, Any]]) -> None:
    """Print the facts docs/design.md §4 relies on, so a re-record against a new vLLM shows what moved."""
    checks: list[tuple[str, Callable[[], object]]] = [
        ("chat_stream", lambda: _stream_facts(recorded["chat_stream"]["chunks"])),
        ("chat_tools_stream", lambda: _stream_facts(recorded["chat_tools_stream"]["chunks"])),
        ("completions_stream", lambda: _stream_facts(recorded["completions_stream"]["chunks"])),
        (
            "turn1 -> turn2 (plain turn) extends",
            lambda: _extends(
                recorded["conversation_turn1"], recorded["conversation_turn2_tool_call"]
            ),
        ),
        (
            "turn2 tool call -> tool result extends",
            lambda: _extends(
                recorded["conversation_turn2_tool_call"], recorded["conversation_turn2_tool_result"]
            ),
        ),
        (
            "tool result -> turn3 (plain turn) extends",
            lambda: _extends(
                recorded["conversation_turn2_tool_result"], recorded["conversation_turn3"]
            ),
        ),
    ]
    for label, check in checks:
        print(f"  {label}: {check()}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--base-url", help="a running vLLM's /v1 URL serving SmolLM2 as `smollm2` with tools"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--only",
        choices=(
            "all", "scale_out", "token_in", "token_in_calls", "responses", "messages", "tree", "tree_handoff",
            "ui_token_text", "teacher",
        ),  # fmt: skip
        default="all",
        help="record every scenario, or only one family (scale_out_*, token_in_*, messages_*, tree_*, tree_handoff_*...)",
    )
    args = parser.parse_args()
    record = {
        "scale_out": record_scale_out,
        "token_in": record_token_in,
        "token_in_calls": record_token_in_calls,
        "responses": record_responses,
        "messages": record_messages,
        "tree": record_tree,
        "teacher": record_teacher,
        "tree_handoff": record_tree_handoff,
        "ui_token_text": record_ui_token_text,
    }.get(args.only, record_all)
    if args.base_url:
        recorder = Recorder(args.base_url, args.out)
        record(recorder)
    else:
        with smollm2_server() as server:
            recorder = Recorder(server.base_url, args.out)
            record(recorder)
    if args.only == "all":
        summarise(recorder.recorded)


if __name__ == "__main__":
    main()
