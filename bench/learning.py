"""Does the loop learn, and which way of learning learns most? SmolLM2-135M on vLLM CPU, the gateway on SQLite and
the trainer, on a demo task (trivia: examples/short_answers.py; tools: examples/tool_agent.py, the multi-turn tool
agent), held-out reward with 95% bootstrap intervals over the held-out questions.

    .venv/bin/python bench/learning.py                       # grpo: trivia, 10 steps, base vs after (~8 min)
    .venv/bin/python bench/learning.py --task tools --token-mode token_in --json /tmp/tools.json
    .venv/bin/python bench/learning.py --objective sft --json /tmp/sft.json        # ~35 min
    .venv/bin/python bench/learning.py --objective distill --json /tmp/distill.json  # ~20 min

--objective grpo (default): one `trajgate demo` run; the held-out reward before and after, the paired change per
question, the share of right answers, wall time per phase, trainer step time and tokens/s, and the swap latency
(step committed -> vLLM answering with the new adapter); for the tool agent also the share of episodes with a valid
tool call, model calls per episode and the merge ratio.

--objective sft (default task: tools): two demo runs back to back, each with its own vLLM: GRPO alone for --steps
steps, then the supervised warm start (the base model plays --sft-rounds rounds; its episodes with reward >=
--sft-min-reward are trained with `trajgate train --sft-data`, trainer/demo/warm_start.py) followed by
--sft-grpo-steps GRPO steps, chosen so both take about the same wall time (both walls are printed). Compared: the
held-out reward after each, and the difference per question (same questions) with its interval.

--objective distill (default task: trivia): one gateway. The teacher is trained by GRPO (run `teacher`, --steps
steps), then the base model is distilled from `teacher@STEPS` (run `student`, loss "distill", the same number of
steps), the teacher served by a second vLLM that serves nothing else (vLLM CPU's engine dies when a prompt_logprobs
request shares a step with another request: docs/objectives.md §10). Held-out reward every --eval-every steps for both: the GRPO curve, the
distillation curve and the teacher's own score, with the student's reverse KL and agreement with the teacher per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere, like the other benchmarks
    sys.path.insert(0, str(REPO))

from gateway.cli import build_parser, demo_options  # noqa: E402
from trainer.checkpoint import latest_checkpoint  # noqa: E402
from trainer.demo.cpu_demo import (  # noqa: E402
    TASKS,
    DemoError,
    DemoOptions,
    DemoResult,
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
from trainer.worker.publish import VllmAdmin  # noqa: E402

Echo = Callable[[str], None]


def interval(c: dict[str, float], key: str, sign: str = "") -> str:
    return f"{c[key]:{sign}.3f} [{c[f'{key}_ci_low']:{sign}.3f}, {c[f'{key}_ci_high']:{sign}.3f}]"


def print_rows(rows: Sequence[tuple[str, str]]) -> None:
    width = max(len(name) for name, _ in rows)
    print()
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


# --objective grpo: one demo run


def grpo_rows(result: DemoResult, options: DemoOptions) -> list[tuple[str, str]]:
    c = result.change
    metrics = [s["metrics"] for s in result.steps if "reward_mean" in s["metrics"]]
    step_s = [m["step_seconds"] for m in metrics]
    tokens_s = [m["tokens_per_s"] for m in metrics]
    swaps = result.swap_seconds
    dropped = sum(m["groups_dropped"] for m in metrics)
    used = sum(m["groups_used"] for m in metrics)
    return [
        ("held-out reward, base (95% CI)", interval(c, "before")),
        (f"held-out reward, after {len(result.steps)} steps", interval(c, "after")),
        ("paired change per question (95% CI)", interval(c, "change", "+")),
        ("after / base", f"{c['after'] / c['before']:.2f}x" if c["before"] else "n/a"),
        ("right answers, base -> after", f"{c['right_before']:.0%} -> {c['right_after']:.0%}"),
        ("held-out questions x answers", f"{c['questions']} x {options.eval_samples}"),
        ("task, token mode", f"{options.task}, {options.token_mode or TASKS[options.task].token_mode}"),
        *_warm_rows(result.warm_start),
        *_tool_rows(result.agent_stats, result.merge),
        ("groups trained / dropped", f"{used} / {dropped}"),
        ("trainer step s, median (min..max)", f"{statistics.median(step_s):.1f} ({min(step_s):.1f}..{max(step_s):.1f})"),
        ("trainer tokens/s, median", f"{statistics.median(tokens_s):.0f}"),
        ("swap latency s, median (max)", f"{statistics.median(swaps):.2f} ({max(swaps):.2f})" if swaps else "n/a"),
        ("wall time", f"{result.wall_seconds / 60:.1f} min"),
        *((f"  {phase}", f"{seconds:.0f} s") for phase, seconds in result.phase_seconds.items()),
    ]  # fmt: skip


def _warm_rows(warm: dict[str, Any]) -> list[tuple[str, str]]:
    if not warm:
        return []
    return [("warm start: episodes right / collected", f"{warm['selected']} / {warm['episodes']}"),
            ("warm start: conversations, sft steps", f"{warm['conversations']}, {warm['steps']}")]  # fmt: skip


def _tool_rows(stats: dict[str, dict[str, float]], merge: dict[str, Any]) -> list[tuple[str, str]]:
    before, after = stats["before"], stats["after"]
    if "tool_call" not in before or "tool_call" not in after:
        return []
    ratio = merge.get("merge_ratio")
    return [
        ("valid tool call, base -> after", f"{before['tool_call']:.0%} -> {after['tool_call']:.0%}"),
        ("malformed tool call, base -> after", f"{before['malformed']:.0%} -> {after['malformed']:.0%}"),
        ("model calls per episode, base -> after", f"{before['calls']:.2f} -> {after['calls']:.2f}"),
        ("merge ratio (all calls of the run)", "n/a" if ratio is None else f"{ratio:.2f}"),
    ]


# --objective sft: GRPO alone vs the supervised warm start + GRPO


def sft_comparison(options: DemoOptions, sft_grpo_steps: int, echo: Echo) -> dict[str, Any]:
    alone = run_demo(replace(options, sft_rounds=0, workdir=options.workdir / "grpo"), echo)
    warm = run_demo(replace(options, steps=sft_grpo_steps, workdir=options.workdir / "sft-grpo"), echo)
    return {"grpo": asdict(alone), "sft_grpo": asdict(warm),
            "difference": paired_change(alone.after, warm.after, options.seed)}  # fmt: skip


def sft_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    alone, warm, diff = result["grpo"], result["sft_grpo"], result["difference"]
    w = warm["warm_start"]
    return [
        ("", "GRPO alone | SFT warm start + GRPO"),
        ("held-out reward, base (95% CI)", f"{interval(alone['change'], 'before')} | {interval(warm['change'], 'before')}"),
        ("held-out reward, after (95% CI)", f"{interval(alone['change'], 'after')} | {interval(warm['change'], 'after')}"),
        ("right answers, base -> after", " | ".join(f"{r['change']['right_before']:.0%} -> {r['change']['right_after']:.0%}"
                                                    for r in (alone, warm))),
        ("steps (supervised + GRPO)", f"0 + {alone['options']['steps']} | {w['steps']} + {warm['options']['steps']}"),
        ("warm start: episodes right / collected", f"- | {w['selected']} / {w['episodes']}"),
        ("wall time", f"{alone['wall_seconds'] / 60:.1f} min | {warm['wall_seconds'] / 60:.1f} min"),
        ("  phases", " | ".join(", ".join(f"{k} {v:.0f}s" for k, v in r["phase_seconds"].items()) for r in (alone, warm))),
        ("after: warm start - alone, per question (95% CI)", interval(diff, "change", "+")),
    ]  # fmt: skip


# --objective distill: the teacher's GRPO curve, then the base model distilled from it


def distill_comparison(options: DemoOptions, eval_every: int, echo: Echo) -> dict[str, Any]:
    workdir = options.workdir.resolve()
    with only_demo_in(workdir):
        return _distill(options, workdir, eval_every, echo)


def _distill(options: DemoOptions, workdir: Path, eval_every: int, echo: Echo) -> dict[str, Any]:
    clock = PhaseClock()

    def say(message: str) -> None:
        echo(f"  bench | {message}")

    task = TASKS[options.task]
    weights, served, database_url = prepare(options.model, workdir, say)
    with processes(echo) as procs:
        vllm_cpus, trainer_cpus = split_cpus(sorted(os.sched_getaffinity(0)))
        vllm = procs.vllm(vllm_server(weights, served, [task, task], options.keep_adapters, vllm_cpus))
        procs.env = demo_env(database_url, vllm, served, weights, workdir)
        gateway, url = start_gateway(procs.start, iter(free_port, None))
        teacher_name = f"teacher@{options.steps}"
        create_run(url, "teacher", served, weights, run_config(options))
        clock.done("start")

        def evaluate(run: str, step: int) -> dict[str, Any]:
            agent = agent_argv(task, url, run, options.seed)
            out = workdir / f"eval-{run}-{step}.json"
            return start_evaluation(procs, f"ev-{run[:2]}{step}", f"{run}@{step}", agent, options, out).result([gateway])

        def train(run: str) -> dict[int, dict[str, Any]]:
            """`run` to --steps in segments of `eval_every`, each a trainer process, evaluated after each."""
            evals: dict[int, dict[str, Any]] = {}
            agent = agent_argv(task, url, run, options.seed)
            done = 0
            for target in [*range(eval_every, options.steps, eval_every), options.steps]:
                trainer = procs.start(f"tr-{run[:2]}", trainer_argv([run], options, trainer_cpus, target - done), 20)
                rounds = procs.start(f"ag-{run[:2]}", rounds_argv(agent, options, target), 10)
                if rounds.wait([gateway], may_finish=[trainer]) != 0 or trainer.wait([gateway]) != 0:
                    raise DemoError(f"training {run} to step {target} failed:\n{trainer.tail()}")
                wait_for_version(url, run, target, gateway)
                say(f"held-out evaluation of {run}@{target}")
                evals[target] = evaluate(run, target)
                clock.done(f"{run}_to_{target}")
                done = target
            return evals

        say("held-out evaluation of the base model")
        base = evaluate("teacher", 0)
        clock.done("eval_base")
        teacher = {0: base, **train("teacher")}
        # On vLLM CPU a prompt_logprobs request that shares an engine step with another request kills the engine
        # (docs/objectives.md §10): the teacher gets a vLLM of its own that serves nothing else, on the trainer's
        # cores (the trainer waits while the teacher scores its step).
        checkpoint = latest_checkpoint(workdir / "checkpoints", "teacher")
        assert checkpoint is not None and checkpoint[0] == options.steps
        scorer = procs.vllm(vllm_server(weights, served, [task], options.keep_adapters, trainer_cpus))
        VllmAdmin(scorer.base_url).load(teacher_name, checkpoint[1])
        student = {**run_config(options), "loss": "distill", "teacher": teacher_name,
                   "teacher_base_url": scorer.base_url}  # fmt: skip
        create_run(url, "student", served, weights, student)
        clock.done("teacher_vllm_start")
        say(f"distilling the base model from {teacher_name} (its own vLLM: {scorer.base_url})")
        distilled = {0: base, **train("student")}
        teacher_steps, _ = run_record(url, "teacher")
        student_steps, _ = run_record(url, "student")

    def curve(evals: dict[int, dict[str, Any]]) -> dict[int, dict[str, float]]:
        return {step: paired_change(base, e, options.seed) for step, e in evals.items()}

    return {
        "options": {**asdict(options), "workdir": str(workdir)},
        "teacher": teacher_name,
        "grpo": curve(teacher),
        "distill": curve(distilled),
        "distill_vs_teacher": paired_change(teacher[options.steps], distilled[options.steps], options.seed),
        "student_steps": [{"step": s["step"], **{k: s["metrics"].get(k) for k in DISTILL_METRICS}} for s in student_steps],
        "teacher_steps": [{"step": s["step"], "reward_mean": s["metrics"].get("reward_mean")} for s in teacher_steps],
        "phase_seconds": clock.seconds,
        "wall_seconds": clock.wall_seconds(),
    }  # fmt: skip


DISTILL_METRICS = ("reverse_kl", "teacher_agreement", "reward_mean", "step_seconds")


def distill_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    grpo, distill = result["grpo"], result["distill"]
    rows = [("step", f"GRPO (the teacher's run) | distilled from {result['teacher']}")]
    for step in sorted(grpo, key=int):
        rows.append((f"  held-out reward @{step} (95% CI)", f"{interval(grpo[step], 'after')} | "
                     f"{interval(distill[step], 'after')}"))  # fmt: skip
    for step in sorted(grpo, key=int):
        rows.append((f"  right answers @{step}", f"{grpo[step]['right_after']:.0%} | {distill[step]['right_after']:.0%}"))
    last = max(grpo, key=int)
    rows += [
        (f"change from base @{last}, per question (95% CI)",
         f"{interval(grpo[last], 'change', '+')} | {interval(distill[last], 'change', '+')}"),
        (f"student - teacher @{last}, per question (95% CI)", interval(result["distill_vs_teacher"], "change", "+")),
    ]  # fmt: skip
    kl = [(s["step"], s["reverse_kl"], s["teacher_agreement"]) for s in result["student_steps"] if s["reverse_kl"] is not None]
    if kl:
        rows += [("student reverse KL / token, first -> last step", f"{kl[0][1]:.4f} -> {kl[-1][1]:.4f}"),
                 ("student agreement with the teacher, first -> last", f"{kl[0][2]:.3f} -> {kl[-1][2]:.3f}")]  # fmt: skip
    rows.append(("wall time", f"{result['wall_seconds'] / 60:.1f} min"))
    rows += [(f"  {phase}", f"{seconds:.0f} s") for phase, seconds in result["phase_seconds"].items()]
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog="Every other flag is `trajgate demo`'s (see `trajgate demo --help`): --task, --steps, --lr, ...",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--objective", choices=["grpo", "sft", "distill"], default="grpo")
    parser.add_argument("--sft-grpo-steps", type=int, help="sft: GRPO steps after the warm start (default: --steps - 4)")
    parser.add_argument("--eval-every", type=int, default=5, help="distill: held-out evaluation every N steps")
    parser.add_argument("--json", type=Path, help="also write every result here")
    args, demo_flags = parser.parse_known_args(argv)
    # The demo's own flags, with more answers per held-out question (a tighter interval) and a scratch workdir.
    defaults = ["--eval-samples", "8", "--workdir", f"/tmp/trajgate-bench-learning-{args.objective}"]
    if args.objective == "sft":
        defaults += ["--task", "tools", "--sft-rounds", "4"]
    demo_args = build_parser().parse_args(["demo", *defaults, *demo_flags])
    options = demo_options(demo_args)
    echo: Echo = lambda line: print(line, flush=True)  # noqa: E731
    try:
        if args.objective == "sft":
            if options.sft_rounds < 1:
                parser.error("--objective sft needs --sft-rounds of at least 1")
            result: Any = sft_comparison(options, args.sft_grpo_steps or max(1, options.steps - 4), echo)
            rows = sft_rows(result)
        elif args.objective == "distill":
            if args.eval_every < 1:
                parser.error("--eval-every must be at least 1")
            result = distill_comparison(options, args.eval_every, echo)
            rows = distill_rows(result)
        else:
            demo = run_demo(options, echo)
            result, rows = asdict(demo), [*grpo_rows(demo, options), ("reward curve", demo.plot)]
    except DemoError as exc:
        print(f"bench/learning: {exc}", file=sys.stderr)
        return 1
    print_rows(rows)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
