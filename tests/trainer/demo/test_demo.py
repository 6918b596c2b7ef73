"""The demo's parts that need no vLLM: the example task's reward, the before/after statistics, the curve, the CLI.
The demo itself runs against real vLLM in tests/e2e/test_demo_e2e.py."""

from __future__ import annotations

import fcntl
import importlib.util
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.cli import build_parser
from gateway.store import db
from tests.support.scripted_server import text_reply
from tests.support.waiting import OutputLines
from trainer.demo.cpu_demo import (
    PORT_TAKEN,
    TASKS,
    Child,
    DemoError,
    DemoOptions,
    DemoResult,
    demo_env,
    model_weights,
    paired_change,
    plot_curve,
    report,
    run_config,
    run_demo,
    split_cpus,
    start_gateway,
    train_argv,
    trainer_argv,
    vllm_server,
)
from trainer.demo.vllm_cpu import VllmServer, free_port, serving_dtype


def _load_agent():  # the example is a script, not part of the package
    spec = importlib.util.spec_from_file_location("short_answers", TASKS["trivia"].agent)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


agent = _load_agent()


def test_reward_pays_for_right_answers_and_then_for_brevity() -> None:
    assert agent.reward("Paris", ("paris",)) == 1.0
    assert agent.reward("Paris.", ("paris",)) == 1.0
    assert agent.reward("The capital of France is Paris.", ("paris",)) == pytest.approx(0.5 + 0.5 / 6)
    assert agent.reward("Lyon", ("paris",)) == 0.0  # one invented or wrong word earns nothing
    assert agent.reward("", ("paris",)) == 0.0
    assert agent.reward("Twenty-four.", ("twenty-four", "24")) == 1.0
    assert agent.reward("It has 8 legs", ("eight", "8")) == pytest.approx(0.5 + 0.5 / 4)
    assert agent.reward("Comparison", ("paris",)) == 0.0  # a word that merely contains the answer is not it


def test_every_accepted_answer_can_match_and_held_out_questions_are_never_trained() -> None:
    for question, accepted in agent.QUESTIONS:
        for answer in accepted:
            assert agent.words(answer) == [answer], (question, answer)  # normalised as answers are
            assert agent.reward(answer.capitalize() + ".", accepted) == 1.0
    held_out = {q for q, _ in agent.HELD_OUT}
    trained = {q for q, _ in agent.TRAIN}
    assert held_out and trained and not held_out & trained
    assert len(held_out | trained) == len(agent.QUESTIONS)  # no question asked twice


def evaluation(rewards: list[list[float]], right: float) -> dict:
    return {"right": right, "questions": [{"rewards": r} for r in rewards]}


def test_paired_change_matches_a_hand_computation() -> None:
    before = evaluation([[0.0, 0.0], [0.5, 0.5], [1.0, 0.0], [0.0, 0.0]], 0.25)
    after = evaluation([[1.0, 1.0], [0.5, 1.0], [1.0, 1.0], [0.0, 0.5]], 0.75)
    change = paired_change(before, after)
    assert change["before"] == pytest.approx((0 + 0.5 + 0.5 + 0) / 4)
    assert change["after"] == pytest.approx((1 + 0.75 + 1 + 0.25) / 4)
    assert change["change"] == pytest.approx((1 + 0.25 + 0.5 + 0.25) / 4)
    # Every question improved, so every bootstrap mean of the differences lies between the smallest and largest.
    assert 0.25 <= change["change_ci_low"] < change["change"] < change["change_ci_high"] <= 1.0
    assert change["right_before"] == 0.25 and change["right_after"] == 0.75
    same = paired_change(before, before)
    assert same["change"] == same["change_ci_low"] == same["change_ci_high"] == 0.0
    with pytest.raises(DemoError, match="different questions"):
        paired_change(before, evaluation([[1.0]], 1.0))


def test_curve_is_a_png(tmp_path: Path) -> None:
    steps = [{"step": k, "metrics": {"reward_mean": 0.1 * k, "reward_std": 0.05}} for k in range(1, 4)]
    change = paired_change(evaluation([[0.0], [0.5]], 0.5), evaluation([[0.5], [1.0]], 1.0))
    path = plot_curve(steps, change, tmp_path / "curve.png", "test")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5_000


def test_the_trainer_command_lines_are_ones_trajgate_train_accepts() -> None:
    options = DemoOptions(steps=7)
    grpo = build_parser().parse_args(trainer_argv(["demo"], options, [1])[3:])
    assert (grpo.command, grpo.run, grpo.steps, grpo.cpus) == ("train", "demo", 7, [1])
    assert build_parser().parse_args(trainer_argv(["a", "b"], options, [1], steps=2)[3:]).steps == 2
    sft = build_parser().parse_args([*train_argv(["demo"], options, [1])[3:], "--sft-data", "x.jsonl"])
    assert (sft.sft_data, sft.steps) == (Path("x.jsonl"), None)  # the file's batches and epochs say how many


def test_run_config_is_one_the_gateway_accepts() -> None:
    from gateway.runs.config import RunConfig

    config = RunConfig.model_validate(run_config(DemoOptions(ahead=2)))
    assert (config.max_staleness, config.admission) == (2, "wait")  # the gateway's admission paces the agent
    assert config.sampling.temperature == 1.0  # the importance ratio assumes samples from the model itself


def test_each_task_gets_its_reply_length_and_the_token_mode_is_one_key() -> None:
    from gateway.runs.config import RunConfig

    assert run_config(DemoOptions())["sampling"]["max_tokens"] == 32
    tools = run_config(DemoOptions(task="tools"))
    assert tools["sampling"]["max_tokens"] == 48  # a hermes tool call is ~32 tokens
    assert run_config(DemoOptions(task="tools", max_tokens=20))["sampling"]["max_tokens"] == 20
    assert tools["token_mode"] == "token_in"  # the tool agent is what token_in is for
    RunConfig.model_validate(tools)
    assert "token_mode" not in run_config(DemoOptions())  # chat is the gateway's default: nothing to send
    assert "token_mode" not in run_config(DemoOptions(task="tools", token_mode="chat"))
    assert TASKS["tools"].vllm_args == ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")


def test_unknown_task_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DemoError, match="--task chess: not one of trivia, tools"):
        run_demo(DemoOptions(task="chess", workdir=tmp_path))


def test_report_shows_tool_use_and_the_merge_ratio() -> None:
    change = paired_change(evaluation([[0.0], [0.5]], 0.25), evaluation([[0.5], [1.0]], 0.75))
    stats = {"before": {"tool_call": 0.5, "calls": 1.5, "malformed": 0.25},
             "after": {"tool_call": 0.875, "calls": 2.0, "malformed": 0.0}}  # fmt: skip
    merge = {"calls": 12, "by_reason": {"first_call": 6, "template_dropped_tool_call": 6}, "merge_ratio": 0.0}
    result = DemoResult(options={}, wall_seconds=60.0, phase_seconds={"train": 30.0}, before={}, after={},
                        change=change, steps=[], swap_seconds=[], plot="/tmp/x/reward_curve.png",
                        agent_stats=stats, merge=merge)  # fmt: skip
    text = report(result)
    assert "valid tool call 50% -> 88%; malformed 25% -> 0%; model calls per episode 1.50 -> 2.00" in text
    assert "merge ratio 0.00" in text and "first_call 6, template_dropped_tool_call 6" in text
    result.agent_stats = {"before": {}, "after": {}}  # trivia: no tool lines
    assert "tool call" not in report(result) and "merge ratio" not in report(result)


def test_unknown_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DemoError, match="not smollm2 or a directory"):
        model_weights(str(tmp_path / "nowhere"))


def test_demo_help_explains_itself() -> None:
    out = subprocess.run([sys.executable, "-m", "gateway.cli", "demo", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for flag in ("--steps", "--model", "--workdir", "--eval-samples", "reward_curve.png", "Ctrl-C", "--task",
                 "--token-mode", "tool_agent.py"):  # fmt: skip
        assert flag in out.stdout


def test_gateway_start_moves_on_from_a_port_taken_meanwhile(tmp_path: Path) -> None:
    database_url = f"sqlite:///{tmp_path / 'gw.db'}"
    db.upgrade(database_url)
    env = {**os.environ, "TRAJGATE_DATABASE_URL": database_url, "TRAJGATE_SPOOL_DIR": str(tmp_path / "spool")}
    children: list[Child] = []

    def start(name: str, argv: Sequence[str], grace_s: float) -> Child:
        children.append(Child(name, argv, env, echo=lambda line: None))
        return children[-1]

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        second = free_port()
        try:
            gateway, url = start_gateway(start, iter([taken.getsockname()[1], second]))
            assert url == f"http://127.0.0.1:{second}" and gateway is children[1]
            assert children[0].proc.returncode == PORT_TAKEN  # the first try found its port in use
            assert httpx.get(url + "/health").json()["status"] == "ok"
        finally:
            for child in children:
                child.stop(10)


def test_second_demo_in_the_same_directory_is_refused(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    workdir.mkdir()
    (workdir / "trajgate.db").write_bytes(b"the first demo's data")
    with open(workdir / ".lock", "w") as held:  # what a running demo holds
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(DemoError, match="another demo is running"):
            run_demo(DemoOptions(workdir=workdir))
    assert (workdir / "trajgate.db").read_bytes() == b"the first demo's data"  # nothing was reset


def test_cli_defaults_are_the_demo_defaults() -> None:
    """`trajgate demo` with no flags runs exactly DemoOptions(): the two lists of defaults cannot drift apart."""
    from gateway.cli import build_parser, demo_options

    assert demo_options(build_parser().parse_args(["demo"])) == DemoOptions()


def test_negative_ahead_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DemoError, match="--ahead must be 0"):
        run_demo(DemoOptions(ahead=-1, workdir=tmp_path))


# A stand-in for the demo: a child process registered the way run_demo registers each of its processes, then the
# wait for the agent's rounds. The CLI turns the KeyboardInterrupt into exit status 130.
_INTERRUPTED_DEMO = """
import sys, time
from trainer.demo.cpu_demo import _stopping_everything_on_exit
try:
    with _stopping_everything_on_exit() as stack:
        stack.callback(print, "children stopped", flush=True)
        print("running", flush=True)
        time.sleep(60)
except KeyboardInterrupt:
    sys.exit(130)
"""


@pytest.mark.parametrize("sigint", ["default", "ignored"])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_stops_the_children_however_the_demo_was_started(sigint: str, signum: int) -> None:
    """A shell without job control starts `cmd &` with SIGINT ignored, and Python then installs no handler of its
    own: the demo ignored Ctrl-C, ran to the end and exited 0 (issue 23's "race" in the Ctrl-C e2e test). The demo
    handles SIGINT itself, whatever disposition it inherited."""
    trap = "trap '' INT; " if sigint == "ignored" else ""
    process = subprocess.Popen(
        ["/bin/sh", "-c", f'{trap}exec "$0" -c "$1"', sys.executable, _INTERRUPTED_DEMO],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    output = OutputLines(process)
    try:
        output.wait_for(lambda line: line == "running", 30, "the demo stand-in to start")
        process.send_signal(signum)
        assert process.wait(10) == 130, output.text()
        assert output.finish() == "running\nchildren stopped"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_an_interrupt_while_a_process_starts_waits_until_its_stop_is_registered() -> None:
    from trainer.demo.cpu_demo import _interrupts_held

    registered = []
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt), _interrupts_held():
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C just after the process was started ...
        registered.append("stop")  # ... still lets the demo register how to stop it
    assert registered == ["stop"]
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before  # handlers restored


def test_trivia_episode_is_one_call_scored_by_the_reward(scripted: Any) -> None:
    """The trivia agent's episode through harness.py: the question with the instruction, the reply scored."""
    server = scripted([text_reply("Paris.")])
    outcome = agent.answer(server.client(), "demo", ("What is the capital of France?", ("paris",)))
    assert (outcome.reward, outcome.correct, outcome.text, outcome.policy_version) == (1.0, True, "Paris.", 3)
    (request,) = server.requests
    assert request["model"] == "demo"
    assert request["messages"] == [{"role": "user", "content": f"What is the capital of France? {agent.INSTRUCTION}"}]


def test_vllm_and_the_trainer_get_disjoint_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    assert split_cpus([0, 1]) == ([0], [1])
    assert split_cpus([0, 1, 2, 3, 4]) == ([0, 1], [2, 3, 4])
    assert split_cpus([3]) == ([3], [3])  # one core: both on it (nothing to split)
    server = VllmServer("/nowhere", "m", cpus=[0, 1])
    assert server.environment()["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in VllmServer("/nowhere", "m").environment()  # vLLM's own binding


def test_vllm_computes_in_float32_where_the_cpu_has_no_bf16(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRAJGATE_VLLM_DTYPE", raising=False)
    cpuinfo = tmp_path / "cpuinfo"
    head = "processor\t: 0\nvendor_id\t: AuthenticAMD\n"
    cpuinfo.write_text(head + "flags\t\t: fpu sse2 avx avx2 fma f16c avx512f\nvmx flags\t: ept amx_bf16\n")
    assert serving_dtype(cpuinfo) == "float32"  # AVX-512 without bf16; "vmx flags" are not the CPU's
    cpuinfo.write_text(head + "flags\t\t: fpu avx2 avx512f avx512_bf16\n")
    assert serving_dtype(cpuinfo) == "bfloat16"
    cpuinfo.write_text(head + "flags\t\t: fpu avx512f amx_bf16 amx_tile\n")
    assert serving_dtype(cpuinfo) == "bfloat16"
    cpuinfo.write_text("processor\t: 0\nFeatures\t: fp asimd sve bf16\n")  # ARM
    assert serving_dtype(cpuinfo) == "bfloat16"
    assert serving_dtype(tmp_path / "absent") == "bfloat16"
    monkeypatch.setenv("TRAJGATE_VLLM_DTYPE", "float32")
    assert serving_dtype(tmp_path / "absent") == "float32"
    assert "float32" in VllmServer("/nowhere", "m").command()


def test_train_cpus_are_a_cpu_list_and_a_bad_one_is_one_line() -> None:
    parser = build_parser()
    assert parser.parse_args(["train", "--run", "r", "--cpus", "0,2-3"]).cpus == [0, 2, 3]
    for bad in ("x", "3-a", ""):
        with pytest.raises(SystemExit):
            parser.parse_args(["train", "--run", "r", "--cpus", bad])
    missing = os.cpu_count() or 1
    out = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "train", "--run", "r", "--cpus", str(missing + 64)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "TRAJGATE_DATABASE_URL": "sqlite:///:memory:"},
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"trajgate train: --cpus {missing + 64}: Invalid argument (this machine has {missing})"
    ]


def test_the_demos_vllm_has_a_slot_per_kept_adapter_and_the_trainer_is_told(tmp_path: Path) -> None:
    """vLLM gets keep-adapters + 1 slots per task's run, and the gateway and trainer the same number
    (TRAJGATE_VLLM_MAX_LORAS), so the trainer's slot check is on in the demo and fits it exactly."""
    one = vllm_server(tmp_path, "m", [TASKS["trivia"]], keep_adapters=2, cpus=[0])
    two = vllm_server(tmp_path, "m", [TASKS["trivia"], TASKS["tools"]], keep_adapters=2, cpus=[0])
    assert (one.max_loras, two.max_loras) == (3, 6)
    assert set(TASKS["tools"].vllm_args) <= set(two.extra_args)  # the tool parser, harmless to trivia
    env = demo_env("sqlite:///x.db", two, "m", tmp_path, tmp_path)
    assert env["TRAJGATE_VLLM_MAX_LORAS"] == "6" and env["TRAJGATE_UPSTREAM_URL"] == two.base_url


def test_the_demos_gateway_writes_at_its_own_priority_unless_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM CPU and the trainer keep every core busy beside the demo's gateway, where a lowered writer stalls the event
    loop (bench/writer_starved.py): the demo's gateway writes at its own priority, unless the user set one."""
    server = vllm_server(tmp_path, "m", [TASKS["trivia"]], keep_adapters=2, cpus=[0])
    monkeypatch.delenv("TRAJGATE_WRITER_NICE", raising=False)
    assert demo_env("sqlite:///x.db", server, "m", tmp_path, tmp_path)["TRAJGATE_WRITER_NICE"] == "0"
    monkeypatch.setenv("TRAJGATE_WRITER_NICE", "7")
    assert demo_env("sqlite:///x.db", server, "m", tmp_path, tmp_path)["TRAJGATE_WRITER_NICE"] == "7"
