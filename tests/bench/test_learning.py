"""bench/learning.py without vLLM: its flags (the objective's defaults, what it refuses) and the comparison tables
from results, so that a long run cannot end in a table that misreads them. The runs themselves are the benchmark
(bench/README.md)."""

from __future__ import annotations

from typing import Any

import pytest

from bench import learning
from trainer.demo.cpu_demo import paired_change


def evaluation(rewards: list[float], right: float) -> dict[str, Any]:
    return {"questions": [{"rewards": [r]} for r in rewards], "right": right}


BASE = evaluation([0.0, 0.1, 0.0, 1.0], 0.25)
WORSE = evaluation([0.0, 0.1, 0.1, 1.0], 0.25)
BETTER = evaluation([1.0, 1.0, 0.1, 1.0], 0.75)


def arm(after: dict[str, Any], steps: int, warm: dict[str, Any]) -> dict[str, Any]:
    return {"change": paired_change(BASE, after), "options": {"steps": steps}, "warm_start": warm,
            "wall_seconds": 600.0, "phase_seconds": {"train": 400.0}}  # fmt: skip


def test_sft_table_puts_each_arm_in_its_column_and_the_difference_is_warm_minus_alone() -> None:
    warm = {"selected": 12, "episodes": 64, "conversations": 11, "steps": 3}
    result = {"grpo": arm(WORSE, 6, {}), "sft_grpo": arm(BETTER, 2, warm), "difference": paired_change(WORSE, BETTER)}
    rows = dict(learning.sft_rows(result))
    assert rows["held-out reward, after (95% CI)"].startswith("0.300 [") and " | 0.775 [" in rows[
        "held-out reward, after (95% CI)"]  # fmt: skip
    assert rows["steps (supervised + GRPO)"] == "0 + 6 | 3 + 2"
    assert rows["warm start: episodes right / collected"] == "- | 12 / 64"
    assert rows["right answers, base -> after"] == "25% -> 25% | 25% -> 75%"
    assert rows["after: warm start - alone, per question (95% CI)"].startswith("+0.475 [")


def test_distill_table_has_a_row_per_evaluated_step_and_the_kl_trend() -> None:
    result = {
        "teacher": "teacher@10",
        "grpo": {0: paired_change(BASE, BASE), 5: paired_change(BASE, WORSE), 10: paired_change(BASE, BETTER)},
        "distill": {0: paired_change(BASE, BASE), 5: paired_change(BASE, BASE), 10: paired_change(BASE, WORSE)},
        "distill_vs_teacher": paired_change(BETTER, WORSE),
        "student_steps": [{"step": 1, "reverse_kl": 0.5, "teacher_agreement": 0.4},
                          {"step": 2, "reverse_kl": 0.2, "teacher_agreement": 0.7}],  # fmt: skip
        "wall_seconds": 60.0,
        "phase_seconds": {"start": 10.0},
    }
    rows = dict(learning.distill_rows(result))
    assert [name for name in rows if name.startswith("  held-out reward @")] == [
        "  held-out reward @0 (95% CI)", "  held-out reward @5 (95% CI)", "  held-out reward @10 (95% CI)"]  # fmt: skip
    assert rows["  held-out reward @10 (95% CI)"].startswith("0.775 [") and " | 0.300 [" in rows[
        "  held-out reward @10 (95% CI)"]  # fmt: skip
    assert rows["student - teacher @10, per question (95% CI)"].startswith("-0.475 [")
    assert rows["student reverse KL / token, first -> last step"] == "0.5000 -> 0.2000"
    assert rows["student agreement with the teacher, first -> last"] == "0.400 -> 0.700"


@pytest.mark.parametrize(
    "argv",
    [["--objective", "sft", "--sft-rounds", "0"], ["--objective", "distill", "--eval-every", "0"]],
)
def test_settings_that_would_measure_nothing_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        learning.main(argv)
    assert exit_info.value.code == 2
    assert argv[2] in capsys.readouterr().err  # the flag at fault is named
