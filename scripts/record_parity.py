"""Build and record the parity corpus: real client requests, and what real vLLM answers to each.

tests/gateway/test_parity.py replays every request of tests/fixtures/parity/ against the gateway (in front of the fake
upstream) and checks its status and the shape of its answer against the answer of vLLM's own endpoint, so the
gateway is never stricter than vLLM on what real clients send. One JSON file per request:

    {
      "name": str,
      "client": "claude-code 2.1.197" | "codex-cli 0.171.0" | "openai-python 2.54.0" | ...,
      "endpoint": "/v1/messages" | "/v1/responses" | "/v1/chat/completions" | "/v1/completions" | ...,
      "headers": {...},        # the client's own headers (x-claude-code-session-id, session-id...); no keys
      "request": {...},        # the body as the client sent it; strings over 400 characters cut (see `trim`)
      "edited": str,           # only where the request was changed by hand, and why
      "note": str,             # only where how it was captured needs saying
      "vllm": {"version": str, "status": int, "response": {...} | null, "events": [[event, data], ...] | null},
      "upstream": [...]        # the exchanges the gateway had with vLLM for it (tests/support/fake_upstream.py's form)
    }

Two steps, each run from the repo root:

    python scripts/record_parity.py corpus CAPTURE.jsonl NAME=LINE ...   # capture lines -> request files
    python scripts/record_parity.py record --base-url http://127.0.0.1:PORT  # vLLM's answers + the gateway's

CAPTURE.jsonl is what a capture server wrote, one `{"method", "path", "headers", "body"}` per request: point the
client at it (Claude Code: ANTHROPIC_BASE_URL; Codex: a model provider's base_url; an SDK: base_url). `record`
needs a vLLM serving SmolLM2 as `smollm2` with the hermes tool parser (`python -m trainer.demo.vllm_cpu serve --tools
--model smollm2 -- --max-model-len 8192`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

OUT = REPO_ROOT / "tests" / "fixtures" / "parity"
MAX_STRING = 400
# Headers kept in a fixture: the client's identity and its session/trajectory hints, never a key.
KEPT_HEADERS = re.compile(r"^(user-agent|anthropic-beta|anthropic-version|x-app|x-claude-code-.*|session-id|"
                          r"thread-id|originator|x-codex-.*|x-client-request-id|x-stainless-(lang|package-version))$")
SECRET_HEADERS = ("authorization", "x-api-key")


def trim(value: Any) -> Any:
    """The body with every long string cut: a CLI's system prompt and tool descriptions are tens of kilobytes of
    prose, where parity lies in the structure (which fields, which block and tool types)."""
    if isinstance(value, str):
        return value if len(value) <= MAX_STRING else value[:MAX_STRING] + " [trimmed]"
    if isinstance(value, list):
        return [trim(item) for item in value]
    if isinstance(value, dict):
        return {key: trim(item) for key, item in value.items()}
    return value


def scrub(text: str, replacements: dict[str, str]) -> str:
    for old, new in replacements.items():
        text = text.replace(old, new)
    return text


def corpus(capture: Path, picks: list[str], client_of: dict[str, str], replacements: dict[str, str]) -> None:
    lines = capture.read_text().splitlines()
    for pick in picks:
        name, _, index = pick.partition("=")
        captured = json.loads(scrub(lines[int(index)], replacements))
        headers = {k.lower(): v for k, v in captured["headers"].items() if KEPT_HEADERS.match(k.lower())}
        agent = headers.get("user-agent", "")
        client = next((c for prefix, c in client_of.items() if agent.startswith(prefix)), agent)
        fixture = {
            "name": name,
            "client": client,
            "endpoint": captured["path"].split("?")[0],
            "query": captured["path"].partition("?")[2],
            "headers": headers,
            "request": trim(captured["body"]),
        }
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / f"{name}.json").write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
        print(f"{name}: {client} {fixture['endpoint']}")


def sse_events(text: str) -> list[list[Any]]:
    """An SSE body as [event name (None when unnamed), data] pairs; `[DONE]` kept as the string it is."""
    events: list[list[Any]] = []
    for block in text.split("\n\n"):
        name, data = None, []
        for line in block.splitlines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if data:
            payload = "\n".join(data)
            events.append([name, payload if payload == "[DONE]" else json.loads(payload)])
    return events


def answer(response: httpx.Response) -> dict[str, Any]:
    """Status and body (JSON, or its SSE events) of one answer."""
    out: dict[str, Any] = {"status": response.status_code, "response": None, "events": None}
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        out["events"] = sse_events(response.text)
    else:
        try:
            out["response"] = response.json()
        except ValueError:
            out["response"] = response.text
    return out


@contextlib.contextmanager
def recording_gateway(root_url: str) -> Iterator[tuple[str, Any]]:
    """A gateway on a scratch SQLite whose upstream is a FakeUpstream forwarding to the real vLLM and keeping
    every exchange."""
    from tests.support.fake_upstream import FakeUpstream
    from tests.support.gateway_harness import running_gateway

    proxy = FakeUpstream(fixtures={}, forward_to=root_url).start()
    try:
        with tempfile.TemporaryDirectory() as tmp, running_gateway(
            database_url=f"sqlite:///{tmp}/trajgate.db",
            upstream_url=proxy.base_url,
            base_model="smollm2",
            spool_dir=f"{tmp}/spool",
        ) as gateway:
            yield gateway.url, proxy
    finally:
        proxy.stop()


def record(root_url: str, names: list[str]) -> None:
    version = httpx.get(f"{root_url}/version").json()["version"]
    paths = sorted(OUT.glob("*.json")) if not names else [OUT / f"{name}.json" for name in names]
    with recording_gateway(root_url) as (gateway_url, proxy):
        for path in paths:
            fixture = json.loads(path.read_text())
            url = fixture["endpoint"] + (f"?{fixture['query']}" if fixture.get("query") else "")
            headers = {"content-type": "application/json", **fixture["headers"]}
            direct = httpx.post(root_url + url, json=fixture["request"], headers=headers, timeout=600)
            fixture["vllm"] = {"version": version, **answer(direct)}
            proxy.recorded.clear()
            through = httpx.post(gateway_url + url, json=fixture["request"], headers=headers, timeout=600)
            fixture["upstream"] = list(proxy.recorded)
            path.write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
            print(f"{fixture['name']}: vLLM {direct.status_code}, gateway {through.status_code}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("corpus", help="capture lines -> request fixtures")
    build.add_argument("capture", type=Path)
    build.add_argument("picks", nargs="+", help="NAME=LINE (0-based line of the capture file)")
    build.add_argument("--client", action="append", default=[], help="USER_AGENT_PREFIX=client name and version")
    build.add_argument("--replace", action="append", default=[], help="OLD=NEW, e.g. a home directory")
    rec = commands.add_parser("record", help="vLLM's answer and the gateway's upstream exchanges for each request")
    rec.add_argument("--base-url", required=True, help="vLLM's root URL, e.g. http://127.0.0.1:8000")
    rec.add_argument("names", nargs="*")
    args = parser.parse_args()
    if args.command == "corpus":
        client_of = dict(item.split("=", 1) for item in args.client)
        replacements = dict(item.split("=", 1) for item in args.replace)
        corpus(args.capture, args.picks, client_of, replacements)
    else:
        record(args.base_url.rstrip("/").removesuffix("/v1"), args.names)


if __name__ == "__main__":
    main()
