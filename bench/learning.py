"""Does the loop learn? Run a demo task (trivia: examples/short_answers.py; tools: examples/tool_agent.py, the
multi-turn tool agent) on SmolLM2-135M, vLLM CPU, the gateway on SQLite and the trainer for N steps, and compare the
held-out reward of the base policy with the policy after N steps.

    .venv/bin/python bench/learning.py                   # trivia, 10 steps, 8 answers per held-out question (~8 min)
    .venv/bin/python bench/learning.py --steps 20 --lr 5e-4 --json /tmp/learning.json
    .venv/bin/python bench/learning.py --task tools --token-mode chat       # the tool agent; then --token-mode token_in

Every figure is measured in this one run: held-out reward before and after with 95% bootstrap intervals over the
questions, the paired change per question with its interval, the share of right answers, wall time per phase,
trainer step time and tokens/s, and the swap latency (step committed -> vLLM answering with the new adapter); for the tool agent also the share of
episodes with a valid tool call, model calls per episode and the merge ratio, so `chat` and `token_in` compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere, like the other benchmarks
    sys.path.insert(0, str(REPO))

from gateway.cli import build_parser, demo_options  # noqa: E402
from trainer.demo.cpu_demo import TASKS, DemoError, run_demo  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog="Every other flag is `trajgate demo`'s (see `trajgate demo --help`): --steps, --lr, --ahead, ...",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", type=Path, help="also write every result here")
    args, demo_flags = parser.parse_known_args()
    # The demo's own flags, with more answers per held-out question (a tighter interval) and a scratch workdir.
    defaults = ["--eval-samples", "8", "--workdir", "/tmp/trajgate-bench-learning"]
    demo_args = build_parser().parse_args(["demo", *defaults, *demo_flags])
    try:
        result = run_demo(demo_options(demo_args), echo=lambda line: print(line, flush=True))
    except DemoError as exc:
        print(f"bench/learning: {exc}", file=sys.stderr)
        return 1

    c = result.change
    metrics = [s["metrics"] for s in result.steps]
    step_s = [m["step_seconds"] for m in metrics]
    tokens_s = [m["tokens_per_s"] for m in metrics]
    swaps = result.swap_seconds
    dropped = sum(m["groups_dropped"] for m in metrics)
    used = sum(m["groups_used"] for m in metrics)
    rows = [
        ("held-out reward, base (95% CI)", f"{c['before']:.3f} [{c['before_ci_low']:.3f}, {c['before_ci_high']:.3f}]"),
        (f"held-out reward, after {len(metrics)} steps", f"{c['after']:.3f} [{c['after_ci_low']:.3f}, {c['after_ci_high']:.3f}]"),
        ("paired change per question (95% CI)", f"{c['change']:+.3f} [{c['change_ci_low']:+.3f}, {c['change_ci_high']:+.3f}]"),
        ("after / base", f"{c['after'] / c['before']:.2f}x" if c["before"] else "n/a"),
        ("right answers, base -> after", f"{c['right_before']:.0%} -> {c['right_after']:.0%}"),
        ("held-out questions x answers", f"{c['questions']} x {demo_args.eval_samples}"),
        ("task, token mode", f"{demo_args.task}, {demo_args.token_mode or TASKS[demo_args.task].token_mode}"),
        *_tool_rows(result.agent_stats, result.merge),
        ("groups trained / dropped", f"{used} / {dropped}"),
        ("trainer step s, median (min..max)", f"{statistics.median(step_s):.1f} ({min(step_s):.1f}..{max(step_s):.1f})"),
        ("trainer tokens/s, median", f"{statistics.median(tokens_s):.0f}"),
        ("swap latency s, median (max)", f"{statistics.median(swaps):.2f} ({max(swaps):.2f})" if swaps else "n/a"),
        ("wall time", f"{result.wall_seconds / 60:.1f} min"),
        *((f"  {phase}", f"{seconds:.0f} s") for phase, seconds in result.phase_seconds.items()),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    print()
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print(f"reward curve: {result.plot}")
    if args.json:
        args.json.write_text(json.dumps(asdict(result), indent=1))
    return 0


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


if __name__ == "__main__":
    sys.exit(main())
