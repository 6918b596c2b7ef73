"""bench/gpu_check.py on CPU with tiny models: GPU windows are short, so the script must not rot
between them. These run the path a GPU lend runs (every stage), on a tiny Qwen2 and Qwen3, and check
that every figure the GPU run must produce is there and sane. No timing is asserted."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from bench import gpu_check
from trainer.samples import Row


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("gpu-check")
    code = gpu_check.main(["--device", "cpu", "--tiny", "--repeats", "2", "--out", str(out)])
    return code, json.loads((out / "gpu_check.json").read_text()), out


def test_tiny_run_finishes_every_stage(tiny_run: tuple[int, dict[str, Any], Path]) -> None:
    code, report, _ = tiny_run
    assert code == 0
    assert report["status"] == "done"
    assert report["peak"]["status"] == "ok" and report["peak"]["flops"] > 0
    assert set(report["step"]) == set(report["numerics"]) == set(gpu_check.TINY_SHAPES)


@pytest.mark.parametrize("shape", sorted(gpu_check.TINY_SHAPES))
def test_step_figures(tiny_run: tuple[int, dict[str, Any], Path], shape: str) -> None:
    step = tiny_run[1]["step"][shape]
    assert step["status"] == "ok", step
    assert step["objective"] == "cispo" and step["backend"] == "hf"
    assert step["tokens"] == 4 * 128 and step["micro_batches"] == 2
    # Two rows per micro-batch share their 32-token prefix: the decoder runs it once per micro-batch.
    assert step["decoder_tokens"] == step["tokens"] - 2 * 32
    for phase in ("step", "bare"):
        figures = step["phases"][phase]
        assert len(figures["times"]) == 2
        assert figures["tokens_per_s"] > 0 and figures["peak_gib"] > 0
        # No upper bound: on a shared CPU the peak and the step see different loads.
        assert math.isfinite(figures["mfu"]) and figures["mfu"] > 0
        # The step's own work skips the LM head on context tokens and the shared prefix's repeats.
        assert 0 < figures["mfu_work"] < figures["mfu"]
    assert "step_bf16_head" not in step["phases"]  # only on CUDA
    assert math.isfinite(step["step_over_bare"]) and step["step_over_bare"] > 0
    assert math.isfinite(step["last_step"]["grad_norm"]) and step["last_step"]["grad_norm"] > 0


@pytest.mark.parametrize("shape", sorted(gpu_check.TINY_SHAPES))
def test_numerics_compare_two_precisions(tiny_run: tuple[int, dict[str, Any], Path], shape: str) -> None:
    numerics = tiny_run[1]["numerics"][shape]
    assert numerics["status"] == "ok", numerics
    assert numerics["positions"] == 2 * 63
    for head in ("fp32_head", "bf16_head"):
        deltas = numerics[head]
        # bf16 against fp32 differs (else both ran in one precision) but only by rounding.
        assert 0 < deltas["mean_abs"] <= deltas["max_abs"] < 0.1


def test_unsloth_reports_what_is_missing(tiny_run: tuple[int, dict[str, Any], Path]) -> None:
    unsloth = tiny_run[1]["unsloth"]
    assert unsloth["status"] == "unavailable"
    assert any("CUDA" in m for m in unsloth["missing"])
    assert unsloth["wheels_mib"] > 64  # more than travels with the tree: the docs say so


def test_markdown_table_written(tiny_run: tuple[int, dict[str, Any], Path]) -> None:
    markdown = (tiny_run[2] / "gpu_check.md").read_text()
    assert "## GRPO step (hf backend)" in markdown and "## Logprobs" in markdown
    for shape in gpu_check.TINY_SHAPES:
        assert sum(line.startswith(f"| {shape} |") for line in markdown.splitlines()) == 2


def test_out_of_memory_retries_smaller_and_is_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tried: list[tuple[int, bool]] = []
    real_measure = gpu_check._measure

    def measure(backend: Any, rows: list[Row], micro_batch_tokens: int, checkpointing: bool, *rest: Any) -> None:
        tried.append((micro_batch_tokens, checkpointing))
        if len(tried) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        real_measure(backend, rows, micro_batch_tokens, checkpointing, *rest)

    monkeypatch.setattr(gpu_check, "_measure", measure)
    out = tmp_path / "out"
    argv = ["--device", "cpu", "--tiny", "--shapes", "tiny-qwen2", "--stages", "step", "--repeats", "1"]
    assert gpu_check.main([*argv, "--out", str(out)]) == 0
    step = json.loads((out / "gpu_check.json").read_text())["step"]["tiny-qwen2"]
    assert tried == [(256, False), (128, False)]
    oom = "CUDA out of memory. Tried to allocate 9.00 GiB"
    assert step["attempts"] == [{"micro_batch_tokens": 256, "gradient_checkpointing": False, "oom": oom}]
    assert step["status"] == "ok" and step["micro_batch_tokens"] == 128 and step["micro_batches"] == 4


def test_attempts_halve_to_one_row_then_checkpoint() -> None:
    assert gpu_check._attempts(8192, 4096) == [(8192, False), (4096, False), (4096, True)]
    assert gpu_check._attempts(4096, 4096) == [(4096, False), (4096, True)]


def test_missing_trainer_module_stops_with_its_wheel_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_check, "TRAINER_EXTRA_MODULES", {"no_such_module_i36": "no_such_module_i36-1.0.whl"})
    assert gpu_check.main(["--device", "cpu", "--tiny", "--out", str(tmp_path)]) == 2
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["status"] == "missing modules"
    assert report["missing_modules"] == {"no_such_module_i36": "no_such_module_i36-1.0.whl"}


def test_wheels_are_unpacked_onto_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "wheeled_i36-1.0-py3-none-any.whl", "w") as archive:
        archive.writestr("wheeled_i36/__init__.py", "ANSWER = 42\n")
    assert gpu_check.use_wheels(wheels) == ["wheeled_i36-1.0-py3-none-any.whl"]
    try:
        import wheeled_i36  # type: ignore[import-not-found]

        assert wheeled_i36.ANSWER == 42
        assert sys.path[0] == str(Path(wheeled_i36.__file__).parents[1])
    finally:
        sys.modules.pop("wheeled_i36", None)
    assert gpu_check.os.environ["PYTHONPATH"].endswith("/elsewhere")


def test_a_stage_without_half_its_budget_left_is_skipped(tmp_path: Path) -> None:
    report = gpu_check.Report(tmp_path, {"environment": {"device": "cpu"}})
    ran: list[dict[str, Any]] = []
    # 10 s in all is 10/480 of the default; a 1,000 s stage would get 21 s of it, half of that > 10.
    failed = gpu_check._stage(report, gpu_check.Clock(10.0), "numerics", "qwen3-4b", 1000.0, ran.append)
    assert not failed and not ran
    assert report.data["numerics"]["qwen3-4b"]["status"].startswith("skipped:")
    assert gpu_check._stage(report, gpu_check.Clock(10.0), "numerics", "tiny", 100.0, ran.append) is False
    assert len(ran) == 1


def test_the_total_budget_stops_the_run_and_keeps_the_report(tmp_path: Path) -> None:
    # Half a second cannot hold two models' builds, steps and numerics: the watchdog must end the run.
    script = Path(gpu_check.__file__)
    argv = [sys.executable, str(script), "--device", "cpu", "--tiny", "--budget-s", "0.5", "--out", str(tmp_path)]
    completed = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert completed.returncode == 3, completed.stdout[-2000:] + completed.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["status"] == "stopped: total budget spent"
    assert "total budget spent" in completed.stdout


def test_unsloth_stage_runs_the_step_in_a_child_and_keeps_its_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pretend the parent may run unsloth: the child (its own process, where unsloth is missing on
    # this CPU) then fails to build the backend, and that reaches the parent's report.
    import trainer.backends.unsloth

    monkeypatch.setattr(trainer.backends.unsloth, "missing_requirements", lambda: [])
    argv = ["--device", "cpu", "--tiny", "--shapes", "tiny-qwen3", "--stages", "unsloth", "--out", str(tmp_path)]
    assert gpu_check.main(argv) == 1
    unsloth = json.loads((tmp_path / "gpu_check.json").read_text())["unsloth"]
    assert unsloth["status"] == "error" and unsloth["returncode"] == 1
    shape = unsloth["step"]["tiny-qwen3"]
    assert shape["status"] == "error" and "unsloth backend needs" in shape["error"]
    assert (tmp_path / "unsloth" / "gpu_check.json").is_file()


def test_weights_in_another_dtype_than_asked_are_refused() -> None:
    linear = torch.nn.Linear(4, 4).requires_grad_(False)
    backend: Any = SimpleNamespace(model=linear)
    gpu_check.check_base_dtype(backend, "float32")
    with pytest.raises(RuntimeError, match="loaded as float32, not bfloat16"):
        gpu_check.check_base_dtype(backend, "bf16")


def test_a_gpu_run_measures_the_three_qwen_shapes(tmp_path: Path) -> None:
    # bench/random_models.py also holds the CPU benchmark's SmolLM2 shape: it must not join the GPU run's default.
    args = gpu_check.parse_args(["--device", "cpu", "--out", str(tmp_path)])
    assert args.shapes == ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen3-4b"]
    assert set(args.shapes) == set(gpu_check.STEP_SECONDS) == set(gpu_check.NUMERICS_SECONDS)
