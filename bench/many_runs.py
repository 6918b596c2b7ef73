"""N runs trained by ONE `trajgate train --runs r1,..,rN` process against N `trajgate train --run ri` processes:
what sharing the base weights saves and what taking turns costs.

For each N (default 1, 2, 4, 8) and each mode, on a fresh SQLite store:
  * N runs created with the same config, each seeded with `--steps` x `--groups-per-step` rewarded groups of
    `--group-size` single-call trajectories: SmolLM2 chat prompts and answers tokenized with its own tokenizer,
    the model's own logprobs (computed here once, fp32), rewards varied within every group so none is dropped;
  * the real trainer (`python -m gateway.cli train --backend hf --device cpu --steps S`), one process for all runs
    or one per run, all launched at once, publishing every step to vLLM: by default a fake vLLM admin server in this
    process that answers as vLLM does (200 plain text on /v1/load_lora_adapter and /v1/unload_lora_adapter, the
    loaded adapters listed by /v1/models, one token from /v1/completions, 404 for an adapter it does not serve),
    or a real vLLM serving the same weights (`--vllm-url`, started with --max-loras >= sum over runs of
    keep_adapters + 1 = 2N at the default --keep-adapters 1);
  * every trainer process with one torch thread (`--threads`): on busy shared cores the threads of one process stall
    each other at every parallel region (two threads made a step here 10-20x slower), so the N processes of a
    mode may use up to N cores where the one process uses one;
  * every trainer process sampled every 0.1 s: VmRSS summed over the live processes (its peak is the mode's
    memory), VmHWM and CPU time (utime + stime) of each at its last sample.

Reported per N and mode: peak RSS summed over processes, the sum of the processes' VmHWM, their CPU seconds, wall
time (launch to the last exit: loading, training, publishing), the median step time, steps per minute per run
(all steps / N / the span from the first step's start to the last step's commit), adapter publication latency
(step committed -> vLLM answers with the adapter: the steps' `swap_seconds`, median and max), the most adapters the
fake vLLM held at once, and the machine's 1-minute load average as the mode ended (other work on the same cores);
then the ratios one process / N processes.

    .venv/bin/python bench/many_runs.py                       # N = 1,2,4,8, 3 steps a run: ~12 min on 2 busy cores
    .venv/bin/python bench/many_runs.py --ns 1,2 --steps 2    # a quick look
    .venv/bin/python bench/many_runs.py --vllm-url http://127.0.0.1:8000/v1 --json many_runs.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from gateway.store import db  # noqa: E402
from gateway.store.runs import steps_after  # noqa: E402
from trainer.demo.seeded_groups import SeededTrajectory, seed_rewarded  # noqa: E402

SERVED = "smollm2"
QUESTIONS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What colour is the sky on a clear day?",
    "What is 7 times 8?",
    "Which planet is closest to the sun?",
    "What do bees make?",
    "How many days are in a week?",
    "What is the boiling point of water in Celsius?",
]
# Four answers of varied quality per question: the rewards differ within each group, so none is dropped.
ANSWERS = [
    ("The answer is {a}.", 1.0),
    ("I think it might be {a}, but I am not sure.", 0.5),
    ("I don't know.", 0.0),
    ("{a}", 0.75),
]
TRUTHS = ["Paris", "eight", "blue", "56", "Mercury", "honey", "seven", "100"]


# ---------------------------------------------------------------------------------------------
# The groups
# ---------------------------------------------------------------------------------------------


class Seeder:
    """SmolLM2's tokens and own logprobs for the seeded groups, computed once for every N and mode."""

    def __init__(self, model_dir: Path, threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        torch.set_num_threads(threads)  # as the trainers: threads on busy shared cores stall each other
        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()
        self._cache: dict[tuple[int, int], tuple[list[int], list[int], list[float]]] = {}

    def _tokens(self, question: int, answer: int) -> tuple[list[int], list[int], list[float]]:
        key = (question, answer)
        if key not in self._cache:
            torch = self._torch
            messages = [{"role": "user", "content": QUESTIONS[question]}]
            chat = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            prompt = self.tokenizer.encode(chat, add_special_tokens=False)
            text = ANSWERS[answer][0].format(a=TRUTHS[question])
            completion = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
            ids = torch.tensor([prompt + completion])
            with torch.no_grad():
                logprobs = torch.log_softmax(self.model(ids).logits[0, :-1].float(), dim=-1)
            values = logprobs[torch.arange(ids.shape[1] - 1), ids[0, 1:]][len(prompt) - 1 :]
            self._cache[key] = (prompt, completion, values.tolist())
        return self._cache[key]

    def groups(self, run: int, count: int, size: int) -> list[SeededTrajectory]:
        """`count` groups of `size` answers for run number `run`, the questions taken in turn."""
        trajectories = []
        for g in range(count):
            question = (run + g) % len(QUESTIONS)
            for t in range(size):
                answer = t % len(ANSWERS)
                prompt, completion, logprobs = self._tokens(question, answer)
                trajectories.append(
                    SeededTrajectory(
                        trajectory_id=f"r{run}-g{g}-t{t}",
                        group_id=f"r{run}-g{g}",
                        prompt_token_ids=prompt,
                        completion_token_ids=completion,
                        completion_logprobs=logprobs,
                        reward=ANSWERS[answer][1],
                    )
                )
        return trajectories


# ---------------------------------------------------------------------------------------------
# A fake vLLM admin
# ---------------------------------------------------------------------------------------------


class FakeVllm:
    """What the trainer's publisher talks to, answering as vLLM 0.x does; counts loads and the most adapters it held
    at once (the slots a real vLLM would need)."""

    def __init__(self) -> None:
        self.adapters: dict[str, str] = {}
        self.loads = 0
        self.peak_loaded = 0
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: Any) -> None:  # quiet
                pass

            def _send(self, status: int, body: bytes, content_type: str | None) -> None:
                self.send_response(status)
                if content_type:
                    self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _json(self, status: int, value: Any) -> None:
                self._send(status, json.dumps(value).encode(), "application/json")

            def _error(self, status: int, message: str) -> None:
                kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "Error")
                self._json(status, {"error": {"message": message, "type": kind, "param": None, "code": status}})

            def do_GET(self) -> None:
                if self.path != "/v1/models":
                    self._error(404, "Not Found")
                    return
                with fake._lock:
                    loaded = dict(fake.adapters)
                base = {"id": SERVED, "object": "model", "owned_by": "vllm", "root": SERVED, "parent": None}
                data = [base] + [
                    {"id": name, "object": "model", "owned_by": "vllm", "root": path, "parent": SERVED}
                    for name, path in loaded.items()
                ]
                self._json(200, {"object": "list", "data": data})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
                if self.path == "/v1/load_lora_adapter":
                    name, path = body.get("lora_name", ""), body.get("lora_path", "")
                    with fake._lock:
                        if name in fake.adapters:
                            self._error(400, f"The lora adapter '{name}' has already been loaded.")
                            return
                        if not (Path(path) / "adapter_config.json").is_file():
                            self._error(404, f"No adapter found for {path}")
                            return
                        fake.adapters[name] = path
                        fake.loads += 1
                        fake.peak_loaded = max(fake.peak_loaded, len(fake.adapters))
                    self._send(200, f"Success: LoRA adapter '{name}' added successfully.".encode(), None)
                elif self.path == "/v1/unload_lora_adapter":
                    name = body.get("lora_name", "")
                    with fake._lock:
                        if fake.adapters.pop(name, None) is None:
                            self._error(404, f"The lora adapter '{name}' cannot be found.")
                            return
                    self._send(200, f"Success: LoRA adapter '{name}' removed successfully.".encode(), None)
                elif self.path == "/v1/completions":
                    model = body.get("model")
                    with fake._lock:
                        known = model == SERVED or model in fake.adapters
                    if not known:
                        self._error(404, f"The model `{model}` does not exist.")
                        return
                    self._json(200, {
                        "id": "cmpl-fake", "object": "text_completion", "created": int(time.time()), "model": model,
                        "choices": [{"index": 0, "text": " a", "logprobs": None, "finish_reason": "length"}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                    })  # fmt: skip
                else:
                    self._error(404, "Not Found")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-vllm", daemon=True)
        self._thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# ---------------------------------------------------------------------------------------------
# The trainer processes
# ---------------------------------------------------------------------------------------------


def _proc_figures(pid: int) -> tuple[int, int, float] | None:
    """(VmRSS, VmHWM) in bytes and CPU seconds (utime + stime) of a live process; None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    kib = {line.split(":")[0]: int(line.split()[1]) for line in status.splitlines() if line.startswith("Vm")}
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    ticks = os.sysconf("SC_CLK_TCK")
    return kib.get("VmRSS", 0) * 1024, kib.get("VmHWM", 0) * 1024, (int(fields[11]) + int(fields[12])) / ticks


class Sampler:
    """Every 0.1 s: the RSS summed over the live processes (its peak kept), and each one's VmHWM and CPU time."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self.peak_rss = 0
        self.hwm: dict[int, int] = {}
        self.cpu: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            total = 0
            for pid in self.pids:
                figures = _proc_figures(pid)
                if figures is not None and figures[1]:  # an exited, unreaped process lists no memory
                    total += figures[0]
                    self.hwm[pid], self.cpu[pid] = figures[1], figures[2]
            self.peak_rss = max(self.peak_rss, total)
            if self._stop.wait(0.1):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Result:
    n: int
    mode: str  # "one" (one process, --runs) or "many" (a process per run)
    processes: int
    peak_rss_mib: float
    sum_hwm_mib: float
    cpu_s: float
    wall_s: float
    span_s: float
    steps_per_min_per_run: float
    publish_p50_s: float
    publish_max_s: float
    peak_adapters: int | None  # the most adapters the fake vLLM held at once (None on a real vLLM)
    step_seconds_p50: float
    load_1m: float  # the machine's 1-minute load average as the mode ended: other work on the same cores
    swap_seconds: list[float] = field(default_factory=list)


def _epoch(value: str | datetime) -> float:
    """A step's created_at (the read API's ISO text) as epoch seconds; naive values are UTC."""
    moment = datetime.fromisoformat(value) if isinstance(value, str) else value
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def _exit_all(processes: list[subprocess.Popen[bytes]]) -> None:
    for proc in processes:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def measure(
    n: int, mode: str, seeder: Seeder, args: argparse.Namespace, workdir: Path, echo: Any = print
) -> Result:
    runs = [f"r{i + 1}" for i in range(n)]
    url = f"sqlite:///{workdir / 'trajgate.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    config = {
        "groups_per_step": args.groups_per_step,
        "learning_rate": 1e-4,
        "loss": "cispo",
        "sampling": {"temperature": 1.0, "max_tokens": 32},
    }
    fake = FakeVllm() if args.vllm_url is None else None
    try:
        for i, run in enumerate(runs):
            trajectories = seeder.groups(i, args.steps * args.groups_per_step, args.group_size)
            seed_rewarded(engine, run, trajectories, config=config, base_model=SERVED, base_weights=str(args.model))
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("TRAJGATE_")},
            "PYTHONPATH": str(REPO),
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "TRAJGATE_DATABASE_URL": url,
            "TRAJGATE_UPSTREAM_URL": args.vllm_url or (fake.base_url if fake else ""),
            "TRAJGATE_CHECKPOINT_DIR": str(workdir / "checkpoints"),
            "TRAJGATE_BASE_MODEL": SERVED,
            "OMP_NUM_THREADS": str(args.threads),
        }
        common = ["--backend", "hf", "--device", "cpu", "--steps", str(args.steps), "--poll-s", "0.2",
                  "--keep-adapters", str(args.keep_adapters), "--publish-timeout-s", "60"]  # fmt: skip
        train = [sys.executable, "-m", "gateway.cli", "train"]
        commands = [[*train, "--runs", ",".join(runs), *common]] if mode == "one" else [
            [*train, "--run", run, *common] for run in runs
        ]
        logs = [workdir / f"trainer-{i}.log" for i in range(len(commands))]
        processes: list[subprocess.Popen[bytes]] = []
        sampler: Sampler | None = None
        started = time.time()
        try:
            for command, log in zip(commands, logs, strict=True):
                with open(log, "wb") as out:
                    processes.append(
                        subprocess.Popen(command, env=env, cwd=workdir, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT)
                    )  # fmt: skip
            sampler = Sampler([p.pid for p in processes])
            deadline = time.monotonic() + args.timeout_s
            for proc, log in zip(processes, logs, strict=True):
                try:
                    code = proc.wait(max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise RuntimeError(f"N={n} {mode}: a trainer ran past {args.timeout_s:.0f}s; see {log}") from None
                if code != 0:
                    tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
                    raise RuntimeError(f"N={n} {mode}: a trainer exited {code}:\n{tail}")
            wall = time.time() - started
            load = os.getloadavg()[0]
        finally:
            if sampler is not None:
                sampler.stop()
            _exit_all(processes)
        steps = {run: steps_after(engine, run) for run in runs}
    finally:
        engine.dispose()
        if fake is not None:
            fake.close()
    missing = {run: len(s) for run, s in steps.items() if len(s) != args.steps}
    if missing:
        raise RuntimeError(f"N={n} {mode}: runs with other than {args.steps} steps: {missing}")
    every = [s for run_steps in steps.values() for s in run_steps]
    begins = [_epoch(s["created_at"]) - s["metrics"]["step_seconds"] for s in every]
    ends = [_epoch(s["created_at"]) for s in every]
    span = max(ends) - min(begins)
    swaps = [s["metrics"].get("swap_seconds") for s in every]
    if any(v is None for v in swaps):
        errors = [s["metrics"].get("publish_error") for s in every]
        raise RuntimeError(f"N={n} {mode}: a step was not published: {errors}")
    swap_values = [float(v) for v in swaps if v is not None]
    return Result(
        n=n,
        mode=mode,
        processes=len(commands),
        peak_rss_mib=sampler.peak_rss / 2**20,
        sum_hwm_mib=sum(sampler.hwm.values()) / 2**20,
        cpu_s=sum(sampler.cpu.values()),
        wall_s=wall,
        span_s=span,
        steps_per_min_per_run=len(every) / span * 60 / n,
        publish_p50_s=statistics.median(swap_values),
        publish_max_s=max(swap_values),
        peak_adapters=fake.peak_loaded if fake is not None else None,
        step_seconds_p50=statistics.median(s["metrics"]["step_seconds"] for s in every),
        load_1m=load,
        swap_seconds=swap_values,
    )


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def table(results: Sequence[Result]) -> str:
    head = (
        f"{'N':>2} {'mode':<12} {'procs':>5} {'peak RSS MiB':>12} {'ΣHWM MiB':>9} {'CPU s':>7} {'wall s':>7} "
        f"{'step s p50':>10} {'steps/min/run':>13} {'publish p50 s':>13} {'publish max s':>13} {'adapters':>8} "
        f"{'load':>5}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        label = "one --runs" if r.mode == "one" else f"{r.n} x --run"
        adapters = "-" if r.peak_adapters is None else str(r.peak_adapters)
        lines.append(
            f"{r.n:>2} {label:<12} {r.processes:>5} {r.peak_rss_mib:>12.0f} {r.sum_hwm_mib:>9.0f} {r.cpu_s:>7.1f} "
            f"{r.wall_s:>7.1f} {r.step_seconds_p50:>10.2f} {r.steps_per_min_per_run:>13.1f} {r.publish_p50_s:>13.3f} "
            f"{r.publish_max_s:>13.3f} {adapters:>8} {r.load_1m:>5.1f}"
        )
    return "\n".join(lines)


def ratios(results: Sequence[Result]) -> str:
    by = {(r.n, r.mode): r for r in results}
    head = f"{'N':>2} {'peak RSS':>9} {'CPU s':>7} {'wall':>7} {'steps/min/run':>13} {'publish p50':>11}"
    lines = ["one process / N processes:", head, "-" * len(head)]
    for n in sorted({r.n for r in results}):
        one, many = by.get((n, "one")), by.get((n, "many"))
        if one is None or many is None:
            continue
        lines.append(
            f"{n:>2} {one.peak_rss_mib / many.peak_rss_mib:>8.2f}x {one.cpu_s / many.cpu_s:>6.2f}x "
            f"{one.wall_s / many.wall_s:>6.2f}x {one.steps_per_min_per_run / many.steps_per_min_per_run:>12.2f}x "
            f"{one.publish_p50_s / many.publish_p50_s:>10.2f}x"
        )
    return "\n".join(lines)


@contextlib.contextmanager
def _workdir(keep: Path | None, label: str) -> Iterator[Path]:
    if keep is not None:
        path = keep / label
        path.mkdir(parents=True, exist_ok=False)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix=f"many-runs-{label}-") as tmp:
        yield Path(tmp)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ns", default="1,2,4,8", help="the numbers of runs to measure (default: 1,2,4,8)")
    parser.add_argument("--steps", type=int, default=3, help="steps each run trains (default: 3)")
    parser.add_argument("--groups-per-step", type=int, default=1, help="default: 1")
    parser.add_argument("--group-size", type=int, default=4, help="trajectories per group (default: 4)")
    parser.add_argument("--keep-adapters", type=int, default=1, help="newest adapters per run kept loaded (default: 1)")
    parser.add_argument("--modes", default="one,many", help="one (a process for all runs), many (one per run)")
    parser.add_argument("--model", type=Path, help="HF weights to train (default: SmolLM2-135M-Instruct, local)")
    parser.add_argument(
        "--vllm-url", help="a real vLLM serving --model as smollm2, --max-loras >= 2N (default: a fake vLLM admin)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per trainer process (default: 1; more threads on busy shared cores stall each other)",
    )
    parser.add_argument("--timeout-s", type=float, default=900.0, help="most seconds one mode may take (default: 900)")
    parser.add_argument("--keep-dir", type=Path, help="keep each mode's database, checkpoints and logs here")
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    args = parser.parse_args(argv)
    ns = [int(n) for n in args.ns.split(",") if n.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not ns or min(ns) < 1 or not set(modes) <= {"one", "many"} or not modes:
        parser.error("--ns takes positive numbers such as 1,2,4 and --modes one, many or both")
    if args.model is None:
        from trainer.demo.cpu_demo import model_weights

        args.model = model_weights("smollm2")[0]
    publication = f"real vLLM at {args.vllm_url}" if args.vllm_url else "fake vLLM admin (in-process, vLLM's answers)"
    print(
        f"model {args.model}; {args.steps} steps a run of {args.groups_per_step} group(s) x {args.group_size}; "
        f"keep_adapters {args.keep_adapters}; {args.threads} torch thread(s) a trainer; publication: {publication}; "
        f"{os.cpu_count()} CPUs",
        flush=True,
    )
    seeder = Seeder(args.model, args.threads)
    results = []
    for n in ns:
        for mode in modes:
            with _workdir(args.keep_dir, f"n{n}-{mode}") as workdir:
                result = measure(n, mode, seeder, args, workdir)
            results.append(result)
            print(f"N={n} {mode}: wall {result.wall_s:.1f}s, peak RSS {result.peak_rss_mib:.0f} MiB, "
                  f"{result.steps_per_min_per_run:.1f} steps/min/run", flush=True)  # fmt: skip
    print()
    print(f"publication: {publication}")
    print(table(results))
    print()
    print(ratios(results))
    if args.json:
        args.json.write_text(json.dumps({
            "model": str(args.model), "publication": publication, "steps": args.steps,
            "groups_per_step": args.groups_per_step, "group_size": args.group_size,
            "keep_adapters": args.keep_adapters, "cpus": os.cpu_count(), "results": [asdict(r) for r in results],
        }, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
