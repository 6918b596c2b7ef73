"""Two different tasks trained at once in one trainer, each its own run and agent key, against each task trained
alone: does sharing vLLM, the gateway and the trainer process change what a task learns? (issue 34, item 5)

    .venv/bin/python bench/two_tasks.py --json /tmp/two_tasks.json       # together, then each alone (~45 min, 2 cores)
    .venv/bin/python bench/two_tasks.py --modes together --steps 2 --groups-per-step 2 --group-size 4 \\
        --eval-samples 2 --eval-limit 6 --max-tokens 16                  # a smoke run of the script (~5 min)
    .venv/bin/python bench/two_tasks.py --table /tmp/two_tasks.json      # the table again from a result file

Together: one vLLM CPU (every task's vLLM arguments, the tool agent's hermes parser included; an adapter slot for
each run's kept adapters plus the one being published), one gateway on SQLite with one agent key bound to each run
(`TRAJGATE_AGENT_KEYS='key-trivia=trivia;key-tools=tools'`, so the admin key is set too), the runs created with each
task's own run config, ONE `trajgate train --runs trivia,tools`, and both example agents at the same time, each with
its own key: held-out evaluation of both on the base model, both agents' training rounds, held-out evaluation of
both after the last step. Alone: `trajgate demo` (trainer.demo.cpu_demo.run_demo) for each task, with the same
settings, seed and steps.

Per task: held-out reward before -> after with 95% bootstrap intervals over the questions, the paired change per
question with its interval, the share of right answers, the trainer's steps of the run, and whether the together and
alone intervals (after, change) overlap; the wall time of each mode. The model is sampled at temperature 1 without a
seed, so two runs of the same mode differ too: overlapping intervals are what "matches" means here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere, like the other benchmarks
    sys.path.insert(0, str(REPO))

from gateway.cli import build_parser, demo_options  # noqa: E402
from trainer.demo.cpu_demo import (  # noqa: E402
    TASKS,
    Child,
    DemoError,
    DemoOptions,
    PhaseClock,
    agent_argv,
    create_run,
    demo_env,
    only_demo_in,
    paired_change,
    prepare,
    processes,
    rounds_argv,
    run_config,
    run_demo,
    run_record,
    split_cpus,
    start_evaluation,
    start_gateway,
    trainer_argv,
    vllm_server,
    wait_for_version,
)
from trainer.demo.vllm_cpu import free_port  # noqa: E402

MODES = ("together", "alone")
ADMIN_KEY = "admin-two-tasks"


def agent_key(task: str) -> str:
    return f"key-{task}"


def agent_keys(tasks: Sequence[str]) -> str:
    """`TRAJGATE_AGENT_KEYS` binding each task's key to its run (the run is named after the task)."""
    return ";".join(f"{agent_key(task)}={task}" for task in tasks)


def run_together(tasks: Sequence[str], options: DemoOptions, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Every task's run on one vLLM, one gateway and one trainer process, the agents playing at the same time."""
    for task in tasks:
        if task not in TASKS:
            raise DemoError(f"--tasks: {task} is not one of {', '.join(TASKS)}")
    if options.ahead < 0:
        raise DemoError("--ahead must be 0 (sample only from the newest policy) or more")
    workdir = (options.workdir / "together").resolve()
    with only_demo_in(workdir):
        return _together(tasks, options, workdir, echo)


def _together(tasks: Sequence[str], options: DemoOptions, workdir: Path, echo: Callable[[str], None]) -> dict[str, Any]:
    clock = PhaseClock()

    def say(message: str) -> None:
        echo(f"   both | {message}")

    weights, served, database_url = prepare(options.model, workdir, say)
    clock.done("prepare")
    with processes(echo) as procs:
        vllm_cpus, trainer_cpus = split_cpus(sorted(os.sched_getaffinity(0)))
        server = vllm_server(weights, served, [TASKS[task] for task in tasks], options.keep_adapters, vllm_cpus)
        say(f"starting vLLM CPU ({served}, {server.max_loras} adapter slots; log {server.log_path})")
        vllm = procs.vllm(server)
        clock.done("vllm_start")
        procs.env = demo_env(database_url, vllm, served, weights, workdir, agent_keys(tasks), ADMIN_KEY)
        gateway, gateway_url = start_gateway(procs.start, iter(free_port, None))
        for task in tasks:
            create_run(gateway_url, task, served, weights, run_config(replace(options, task=task)), ADMIN_KEY)
        say(f"gateway on {gateway_url}; runs {', '.join(tasks)} created, each with its own agent key")
        trainer = procs.start("trainer", trainer_argv(tasks, options, trainer_cpus), 20)
        agents = {task: agent_argv(TASKS[task], gateway_url, task, options.seed, agent_key(task), ADMIN_KEY)
                  for task in tasks}  # fmt: skip

        def evaluate(label: str, others: Sequence[Child]) -> dict[str, dict[str, Any]]:
            running = {task: start_evaluation(procs, f"{task}:eval-{label[:2]}", f"{task} {label}", agents[task],
                                              options, workdir / f"eval-{task}-{label}.json")
                       for task in tasks}  # fmt: skip
            return {task: evaluation.result(others) for task, evaluation in running.items()}

        say(f"held-out evaluation of the base model for every task ({options.eval_samples} answers per question)")
        before = evaluate("before", [gateway, trainer])
        clock.done("eval_before")
        say(f"training {', '.join(tasks)} at once: {options.steps} steps each of {options.groups_per_step} groups x "
            f"{options.group_size} answers")  # fmt: skip
        rounds = {task: procs.start(f"{task}:agent", rounds_argv(agents[task], options), 10) for task in tasks}
        for task, child in rounds.items():
            # The trainer may finish first (see trajgate demo), and so may the other agents.
            others = [other for other in rounds.values() if other is not child]
            if child.wait([gateway], may_finish=[trainer, *others]) != 0:
                raise DemoError(f"the {task} agent's training rounds failed")
        if trainer.wait([gateway]) != 0:
            raise DemoError(f"the trainer failed:\n{trainer.tail()}")
        for task in tasks:
            wait_for_version(gateway_url, task, options.steps, gateway, ADMIN_KEY)
        clock.done("train")
        say(f"held-out evaluation of every run at step {options.steps}")
        after = evaluate("after", [gateway])
        clock.done("eval_after")
        records = {task: run_record(gateway_url, task, ADMIN_KEY) for task in tasks}

    runs = {task: _run_entry(before[task], after[task], records[task][0], options.seed) for task in tasks}
    return {"wall_seconds": clock.wall_seconds(), "phase_seconds": clock.seconds, "runs": runs}


def run_alone(tasks: Sequence[str], options: DemoOptions, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Each task by itself, as `trajgate demo --task TASK` runs it, one after the other."""
    started = time.monotonic()
    runs = {}
    for task in tasks:
        result = run_demo(replace(options, task=task, workdir=options.workdir / f"alone-{task}"), echo)
        runs[task] = {**_run_entry(result.before, result.after, result.steps, options.seed),
                      "wall_seconds": result.wall_seconds, "phase_seconds": result.phase_seconds}  # fmt: skip
    return {"wall_seconds": round(time.monotonic() - started, 1), "runs": runs}


def _run_entry(before: dict[str, Any], after: dict[str, Any], steps: list[dict[str, Any]], seed: int) -> dict[str, Any]:
    return {
        "change": paired_change(before, after, seed),
        "trainer_steps": len(steps),
        "groups_trained": sum(s["metrics"].get("groups_used", 0) for s in steps),
        "stats": {"before": before.get("stats", {}), "after": after.get("stats", {})},
        "before": before,
        "after": after,
    }


def overlaps(low_a: float, high_a: float, low_b: float, high_b: float) -> bool:
    """Two closed intervals share a point."""
    return low_a <= high_b and low_b <= high_a


def verdict(result: dict[str, Any]) -> dict[str, dict[str, bool]]:
    """Per task run in both modes: do the together and alone intervals of the held-out reward after training, and
    of the paired change, overlap?"""
    modes = result["modes"]
    if not all(mode in modes for mode in MODES):
        return {}
    out = {}
    for task in result["tasks"]:
        if task not in modes["together"]["runs"] or task not in modes["alone"]["runs"]:
            continue
        a, b = modes["together"]["runs"][task]["change"], modes["alone"]["runs"][task]["change"]
        out[task] = {
            key: overlaps(a[f"{key}_ci_low"], a[f"{key}_ci_high"], b[f"{key}_ci_low"], b[f"{key}_ci_high"])
            for key in ("after", "change")
        }
    return out


def table(result: dict[str, Any]) -> str:
    """The result as text: per task a row per figure, a column per mode that ran; then the wall time of each mode."""
    modes = [mode for mode in MODES if mode in result["modes"]]
    checks = verdict(result)
    lines = []
    for task in result["tasks"]:
        entries = {mode: result["modes"][mode]["runs"][task] for mode in modes if task in result["modes"][mode]["runs"]}
        if not entries:
            continue

        def interval(c: dict[str, float], key: str, sign: str = "") -> str:
            return f"{c[key]:{sign}.3f} [{c[f'{key}_ci_low']:{sign}.3f}, {c[f'{key}_ci_high']:{sign}.3f}]"

        rows: list[tuple[str, list[str]]] = [
            ("held-out reward, base (95% CI)", [interval(e["change"], "before") for e in entries.values()]),
            ("held-out reward, after (95% CI)", [interval(e["change"], "after") for e in entries.values()]),
            ("paired change per question (95% CI)", [interval(e["change"], "change", "+") for e in entries.values()]),
            ("right answers, base -> after",
             [f"{e['change']['right_before']:.0%} -> {e['change']['right_after']:.0%}" for e in entries.values()]),
            ("trainer steps (groups trained)",
             [f"{e['trainer_steps']} ({e['groups_trained']})" for e in entries.values()]),
        ]  # fmt: skip
        if all("tool_call" in e["stats"]["before"] and "tool_call" in e["stats"]["after"] for e in entries.values()):
            rows.append(("valid tool call, base -> after",
                         [f"{e['stats']['before']['tool_call']:.0%} -> {e['stats']['after']['tool_call']:.0%}"
                          for e in entries.values()]))  # fmt: skip
        questions = next(iter(entries.values()))["change"]["questions"]
        header = (f"task {task} ({questions} held-out questions)", list(entries))
        width = max(len(name) for name, _ in [header, *rows])
        cell = max(len(value) for _, values in [header, *rows] for value in values) + 2
        lines.append("")
        for name, values in [header, *rows]:
            lines.append(f"{name:<{width}}  " + "".join(f"{value:<{cell}}" for value in values).rstrip())
        if task in checks:
            yes = {True: "overlap", False: "do NOT overlap"}
            lines.append(f"together vs alone: after intervals {yes[checks[task]['after']]}, change intervals "
                         f"{yes[checks[task]['change']]}")  # fmt: skip
    lines.append("")
    for mode in modes:
        data = result["modes"][mode]
        parts = ", ".join(f"{task} {run['wall_seconds'] / 60:.1f} min" for task, run in data["runs"].items()
                          if "wall_seconds" in run)  # fmt: skip
        phases = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in data.get("phase_seconds", {}).items())
        details = "".join(f" ({text})" for text in (parts, phases) if text)
        lines.append(f"wall time {mode}: {data['wall_seconds'] / 60:.1f} min{details}")
    return "\n".join(lines)


def parse(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, DemoOptions]:
    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog="Every other flag is `trajgate demo`'s (see `trajgate demo --help`): --steps, --lr, --groups-per-step, "
        "--group-size, --eval-samples, --eval-limit, --max-tokens, --seed, --workdir ...; --task is this script's "
        "--tasks.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--tasks", default="trivia,tools", help="the tasks, comma-separated (each its run and key)")
    parser.add_argument("--modes", default="together,alone", help="together, alone or both (in that order)")
    parser.add_argument("--json", type=Path, help="also write every result here (after each mode)")
    parser.add_argument("--table", type=Path, metavar="JSON", help="only print the table of a result file")
    args, demo_flags = parser.parse_known_args(argv)
    args.tasks = [task.strip() for task in args.tasks.split(",") if task.strip()]
    args.modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    for task in args.tasks:
        if task not in TASKS:
            parser.error(f"--tasks: {task} is not one of {', '.join(TASKS)}")
    if len(set(args.tasks)) != len(args.tasks) or not args.tasks:
        parser.error("--tasks: name each task once")
    if not args.modes or any(mode not in MODES for mode in args.modes):
        parser.error(f"--modes: a comma-separated list of {', '.join(MODES)}")
    # bench/learning.py's defaults: more answers per held-out question (a tighter interval), a scratch workdir.
    defaults = ["--eval-samples", "8", "--workdir", "/tmp/trajgate-bench-two-tasks"]
    return args, demo_options(build_parser().parse_args(["demo", *defaults, *demo_flags]))


def main(argv: Sequence[str] | None = None) -> int:
    args, options = parse(argv)
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return 0
    result: dict[str, Any] = {"options": {**asdict(options), "workdir": str(options.workdir)}, "tasks": args.tasks,
                              "modes": {}}  # fmt: skip
    run = {"together": run_together, "alone": run_alone}
    try:
        for mode in args.modes:
            result["modes"][mode] = run[mode](args.tasks, options, lambda line: print(line, flush=True))
            result["verdict"] = verdict(result)
            if args.json:
                args.json.write_text(json.dumps(result, indent=1))
    except DemoError as exc:
        print(f"bench/two_tasks: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench/two_tasks: interrupted; every process it started has stopped", file=sys.stderr)
        return 130
    finally:
        if result["modes"]:
            print(table(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
