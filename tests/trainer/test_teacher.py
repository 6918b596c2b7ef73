"""The distillation teacher's client against real vLLM 0.32's recorded prompt_logprobs answer
(tests/fixtures/vllm/teacher_prompt_logprobs.json, `python scripts/record_fixtures.py --only teacher`), its refusal of
anything partial, its waiting while the teacher is unreachable, and the per-step store that makes a retried step
exact."""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from trainer.teacher import (
    Teacher,
    TeacherAnswerError,
    TeacherStore,
    parse_prompt_logprobs,
    request_body,
    row_key,
    teacher_logprobs_for_step,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


RECORDED = fixture("teacher_prompt_logprobs")
SEQUENCES: list[list[int]] = RECORDED["request"]["prompt"]


def test_the_recorded_request_is_the_one_the_client_sends() -> None:
    assert RECORDED["request"] == request_body("smollm2", SEQUENCES) and RECORDED["status"] == 200
    refused = fixture("error_teacher_max_tokens_0")  # why max_tokens is 1: vLLM refuses 0
    assert refused["status"] == 400 and "max_tokens" in refused["response"]["error"]["message"]


def test_real_prompt_logprobs_parse_into_the_row_layout_and_match_the_students_own() -> None:
    scored = parse_prompt_logprobs(RECORDED["response"], SEQUENCES)
    assert [len(s) for s in scored] == [len(ids) for ids in SEQUENCES] and all(s[0] == 0.0 for s in scored)
    assert all(lp < 0 for s in scored for lp in s[1:])
    # The sequences are the prompt + completion of two recorded calls of the same model: the teacher (that model) must
    # give the completion tokens the logprobs vLLM recorded when it sampled them (reverse KL ≈ 0 against itself).
    for sequence, name in zip(scored, ("chat", "chat_n2_seeded"), strict=True):
        call = fixture(name)["response"]
        sampled = [entry["logprob"] for entry in call["choices"][0]["logprobs"]["content"]]
        completion = sequence[len(call["prompt_token_ids"]) :]
        assert len(completion) == len(sampled)
        assert completion == pytest.approx(sampled, abs=0.02)


def broken(edit: str) -> dict[str, Any]:
    answer = copy.deepcopy(RECORDED["response"])
    choices = answer["choices"]
    if edit == "missing position":
        choices[1]["prompt_logprobs"][7] = None
    elif edit == "other token":
        choices[0]["prompt_logprobs"][3] = {"99999": {"logprob": -1.0, "rank": 1}}
    elif edit == "short":
        choices[0]["prompt_logprobs"].pop()
    elif edit == "one choice":
        choices.pop()
    elif edit == "other ids":
        choices[0]["prompt_token_ids"] = choices[0]["prompt_token_ids"][:-1] + [5]
    elif edit == "nan":
        (entry,) = choices[0]["prompt_logprobs"][4].values()
        entry["logprob"] = float("nan")
    elif edit == "same index":
        choices[1]["index"] = 0
    return answer


@pytest.mark.parametrize(
    "edit", ["missing position", "other token", "short", "one choice", "other ids", "nan", "same index"]
)
def test_anything_partial_is_an_error_for_the_whole_batch(edit: str) -> None:
    with pytest.raises(TeacherAnswerError):
        parse_prompt_logprobs(broken(edit), SEQUENCES)


class Replay:
    """Serves the recorded answer for the recorded request; the first `outages` requests answer 503, and `status`
    replaces the answer's status when set."""

    def __init__(self, outages: int = 0, status: int | None = None) -> None:
        self.outages, self.status, self.bodies = outages, status, []
        replay = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                replay.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                status = 503 if len(replay.bodies) <= replay.outages else (replay.status or 200)
                data = RECORDED["raw_body"].encode() if status == 200 else b'{"error": {"message": "no"}}'
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def replay() -> Iterator[Replay]:
    server = Replay(outages=2)
    yield server
    server.close()


def test_the_step_waits_while_the_teacher_is_unreachable_then_scores(replay: Replay) -> None:
    said: list[str] = []
    teacher = Teacher("smollm2", replay.base_url, batch_size=2, backoff_s=0.01)  # the recorded two-row request
    scored = teacher.score(SEQUENCES, echo=said.append)
    assert scored == parse_prompt_logprobs(RECORDED["response"], SEQUENCES)
    assert len(replay.bodies) == 3 and all(b == RECORDED["request"] for b in replay.bodies)
    assert len(said) == 2 and all("unreachable (HTTP 503" in s and "the step waits" in s for s in said)


def test_a_teacher_that_never_answers_gives_nothing() -> None:
    teacher = Teacher("smollm2", "http://127.0.0.1:1/v1", backoff_s=0.01, max_wait_s=0.02)
    with pytest.raises(TimeoutError, match="still unreachable"):
        teacher.score(SEQUENCES)
    stop = threading.Event()
    stop.set()
    with pytest.raises(InterruptedError):
        Teacher("smollm2", "http://127.0.0.1:1/v1").score(SEQUENCES, stop=stop)


def test_a_refusal_is_an_error_not_a_wait() -> None:
    server = Replay(status=400)
    try:
        with pytest.raises(TeacherAnswerError, match="refused the request \\(400\\)"):
            Teacher("smollm2", server.base_url, batch_size=2, backoff_s=0.01).score(SEQUENCES)
        assert len(server.bodies) == 1
    finally:
        server.close()


def test_a_retried_step_reuses_the_stored_logprobs_exactly(tmp_path: Path) -> None:
    store = TeacherStore(tmp_path / "teacher")
    server = Replay()
    try:
        first = teacher_logprobs_for_step(Teacher("smollm2", server.base_url, batch_size=2), store, 3, SEQUENCES)
        assert first == parse_prompt_logprobs(RECORDED["response"], SEQUENCES) and len(server.bodies) == 1
    finally:
        server.close()
    assert store.path(3).exists() and set(store.load(3)) == {row_key("smollm2", ids) for ids in SEQUENCES}
    # the teacher is gone now: the retried step 3 trains against what step 3 stored, bit for bit
    gone = Teacher("smollm2", "http://127.0.0.1:1/v1", max_wait_s=0)
    assert teacher_logprobs_for_step(gone, store, 3, list(reversed(SEQUENCES))) == list(reversed(first))
    # ... but another step, another teacher or a row it never scored asks the teacher
    for step, teacher, rows in ((4, gone, SEQUENCES), (3, Teacher("other", gone.base_url, max_wait_s=0), SEQUENCES),
                                (3, gone, [SEQUENCES[0], SEQUENCES[1][:-1]])):  # fmt: skip
        with pytest.raises(TimeoutError):
            teacher_logprobs_for_step(teacher, store, step, rows)


@pytest.mark.parametrize(
    ("env", "base_url", "expected"),
    [
        ({}, None, None),
        ({"upstream_api_key": "up"}, None, "up"),  # the run's own vLLM: its key
        ({"upstream_api_key": "up"}, "http://teacher:9000/v1", None),  # never sent to another endpoint
        ({"upstream_api_key": "up", "teacher_api_key": "t"}, "http://teacher:9000/v1", "t"),
        ({"upstream_api_key": "up", "teacher_api_key": "t"}, None, "t"),
        ({"teacher_api_key": "  "}, "http://teacher:9000/v1", None),  # blank is unset
    ],
)
def test_the_teachers_key(env: dict[str, str], base_url: str | None, expected: str | None) -> None:
    from gateway.runs.config import RunConfig
    from gateway.runs.settings import load_settings
    from trainer.worker.loop import make_teacher

    settings = load_settings(_env_file=None, upstream_url="http://vllm:8001/v1", **env)
    config = RunConfig.model_validate({"loss": "distill", "teacher": "big", "teacher_base_url": base_url})
    teacher = make_teacher(config, settings)
    assert teacher is not None and teacher.api_key == expected
    assert teacher.base_url == (base_url or "http://vllm:8001/v1")
