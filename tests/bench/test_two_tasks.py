"""bench/two_tasks.py without vLLM: the agent keys each task's run is bound to and that its agent sends, the
together-vs-alone verdict and the table from a result. The long run itself is the benchmark (bench/README.md)."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from bench import two_tasks
from gateway.runs.settings import Settings, parse_agent_keys
from tests.support.scripted_server import text_reply
from trainer.demo.cpu_demo import TASKS, DemoOptions, paired_change


def test_each_task_key_is_bound_to_its_run_only() -> None:
    keys = parse_agent_keys(two_tasks.agent_keys(["trivia", "tools"]))
    assert {key.get_secret_value(): key.runs for key in keys} == {
        "key-trivia": frozenset({"trivia"}),
        "key-tools": frozenset({"tools"}),
    }
    # Bound keys need the admin key: the gateway would refuse to start without it.
    settings = Settings(agent_keys=two_tasks.agent_keys(["trivia", "tools"]), admin_key=two_tasks.ADMIN_KEY)
    assert settings.admin_key is not None and len(settings.agent_keys) == 2


class _Gateway:
    """Just enough of a gateway for the example agent: chat completions, rewards, the run's progress; it keeps the
    Authorization header of every request."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str | None]] = []
        seen = self.seen

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, body: dict[str, Any]) -> None:
                seen.append((self.command, self.path, self.headers.get("authorization")))
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.send_header("x-policy-version", "0")
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:  # noqa: N802 - the name http.server looks for
                self.rfile.read(int(self.headers["content-length"]))
                self._answer(text_reply("Paris.") if self.path.endswith("/chat/completions") else {"ok": True})

            def do_GET(self) -> None:  # noqa: N802
                self._answer({"policy_version": 1, "last_step": {"step": 1}, "groups": {}})

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def gateway() -> Iterator[_Gateway]:
    server = _Gateway()
    yield server
    server.server.shutdown()
    server.server.server_close()


def test_the_agent_calls_and_rewards_with_its_key_and_reads_progress_with_the_admin_key(
    gateway: _Gateway, tmp_path: Path
) -> None:
    argv = two_tasks.agent_argv(TASKS["trivia"], gateway.url, "trivia", 0, "key-trivia", "admin-k")
    out = tmp_path / "eval.json"
    evaluation = subprocess.run([*argv, "eval", "--samples", "2", "--limit", "1", "--out", str(out)],
                                capture_output=True, text=True, timeout=120)  # fmt: skip
    assert evaluation.returncode == 0, evaluation.stderr
    assert json.loads(out.read_text())["run"] == "trivia"
    posts = [(path, key) for method, path, key in gateway.seen if method == "POST"]
    assert len(posts) == 4  # two episodes: a model call and a reward each
    assert {key for _, key in posts} == {"Bearer key-trivia"}
    assert sum(path.endswith("/reward") for path, _ in posts) == 2
    gateway.seen.clear()
    rounds = subprocess.run([*argv, "train", "--steps", "1"], capture_output=True, text=True, timeout=120)
    assert rounds.returncode == 0, rounds.stderr
    assert gateway.seen == [("GET", "/v1/runs/trivia", "Bearer admin-k")]  # the run has its steps: no round


def _evaluation(means: list[float], right: float) -> dict[str, Any]:
    return {"right": right, "stats": {}, "questions": [{"rewards": [m, m]} for m in means]}


def _entry(before: list[float], after: list[float], steps: int = 10) -> dict[str, Any]:
    return {
        "change": paired_change(_evaluation(before, 0.25), _evaluation(after, 0.5)),
        "trainer_steps": steps,
        "groups_trained": 4 * steps,
        "stats": {"before": {}, "after": {}},
    }


def _result(together: dict[str, Any], alone: dict[str, Any] | None) -> dict[str, Any]:
    together_mode = {"wall_seconds": 600.0, "phase_seconds": {"train": 420.0}, "runs": {"trivia": together}}
    modes: dict[str, Any] = {"together": together_mode}
    if alone is not None:
        modes["alone"] = {"wall_seconds": 900.0, "runs": {"trivia": {**alone, "wall_seconds": 900.0}}}
    return {"tasks": ["trivia"], "modes": modes}


def test_overlap_is_of_closed_intervals() -> None:
    assert two_tasks.overlaps(0.1, 0.3, 0.3, 0.5)  # touching
    assert two_tasks.overlaps(0.1, 0.9, 0.3, 0.5)  # one inside the other
    assert not two_tasks.overlaps(0.1, 0.29, 0.3, 0.5)
    assert not two_tasks.overlaps(0.6, 0.7, 0.3, 0.5)


def test_same_results_overlap_and_far_apart_ones_do_not() -> None:
    learned = _entry([0.0, 0.2, 0.1, 0.3], [0.6, 0.8, 0.7, 0.9])
    same = _result(learned, learned)
    assert two_tasks.verdict(same) == {"trivia": {"after": True, "change": True}}
    flat = _entry([0.0, 0.2, 0.1, 0.3], [0.0, 0.2, 0.1, 0.3])  # together learned nothing; alone learned a lot
    apart = _result(flat, learned)
    assert two_tasks.verdict(apart) == {"trivia": {"after": False, "change": False}}
    text = two_tasks.table(apart)
    assert "after intervals do NOT overlap, change intervals do NOT overlap" in text
    assert "wall time together: 10.0 min (train 420 s)" in text
    assert "wall time alone: 15.0 min (trivia 15.0 min)" in text
    header = next(line for line in text.splitlines() if line.startswith("task trivia"))
    assert header.split()[-2:] == ["together", "alone"] and "(4 held-out questions)" in header
    after = next(line for line in text.splitlines() if line.startswith("held-out reward, after"))
    assert after.count("[") == 2 and "0.150 [" in after and "0.750 [" in after
    assert "10 (40)" in text  # trainer steps (groups trained)


def test_one_mode_gives_its_column_and_no_verdict() -> None:
    result = _result(_entry([0.0, 0.5], [0.5, 1.0]), None)
    assert two_tasks.verdict(result) == {}
    text = two_tasks.table(result)
    assert "overlap" not in text and "alone" not in text
    assert "right answers, base -> after" in text and "25% -> 50%" in text


def test_flags_are_the_demo_flags_plus_tasks_and_modes(tmp_path: Path) -> None:
    args, options = two_tasks.parse(["--steps", "3", "--modes", "alone", "--workdir", str(tmp_path)])
    assert args.tasks == ["trivia", "tools"] and args.modes == ["alone"]
    assert (options.steps, options.eval_samples, options.workdir) == (3, 8, tmp_path)  # 8: bench/learning's default
    assert options == DemoOptions(steps=3, eval_samples=8, workdir=tmp_path)
    for bad in (["--tasks", "chess"], ["--tasks", "trivia,trivia"], ["--modes", "apart"]):
        with pytest.raises(SystemExit):
            two_tasks.parse(bad)
