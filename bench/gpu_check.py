"""The trainer on a GPU in one prepared command (issue 36): every figure of a GPU lend in one run.

GPU time comes in short windows, so this script is proven on CPU (``--device cpu --tiny``, a test runs
it) and then run once on the GPU. Stages, in order, each with a time budget (``--budget-s`` scales
them all), the JSON and the markdown table rewritten after each measurement so a kill still leaves
figures:

  * ``peak``: the device's matmul peak, a loop of large GEMMs in the dtype the model trains in (bf16
    8192² on CUDA), best of several timings: MFU's denominator, measured in the same run;
  * ``step``: the backend's real GRPO step (``TrainerBackend.train_step`` → ``trainer.step``, the run's
    default objective, LoRA r16 α32 on all linear layers, bf16 on CUDA) on random weights of the real
    shapes of Qwen2.5-0.5B, Qwen2.5-1.5B and Qwen3-4B; 16k tokens per step as 4 rows of 4,096 with a
    shared 1,024-token prompt prefix. Against it, alternating, a bare forward+backward of the same
    micro-batches (``bench/trainer_step.py``'s: the model's own full-logits cross-entropy, LoRA
    attached, no optimizer) and, on CUDA, the step with a bf16 LM head. tokens/s, seconds, peak
    memory, MFU, step/bare. An out-of-memory halves the micro-batch, then turns on gradient
    checkpointing, and is recorded;
  * ``numerics``: the trainer's logprobs (``token_logprobs``) of a fixed batch in bf16 on the device,
    with the default fp32 LM head and with a bf16 one, against fp32 on the CPU: mean / max |Δ|;
  * ``unsloth``: the ``step`` stage with the unsloth backend in a child process (unsloth must be
    imported before transformers) when it can run here; otherwise what is missing and which wheels
    would have to travel.

    python bench/gpu_check.py --out /tmp/gpu-check                          # the GPU run (≤ 8 min on an H100)
    python bench/gpu_check.py --device cpu --tiny --out /tmp/gpu-check      # every stage, tiny model, seconds
    python bench/gpu_check.py --wheels gpu-wheels --out "$OUT"              # wheels unpacked onto sys.path first

docs/gpu.md says what to bring and where the figures go.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.random_models import SHAPES, TINY_SHAPES, build_random_model, shape_spec  # noqa: E402

if TYPE_CHECKING:
    from trainer.backends import TrainerBackend
    from trainer.samples import Row

# The shapes a GPU run measures unless --shapes says otherwise (random_models.SHAPES also has the CPU benchmark's).
GPU_SHAPES = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen3-4b")

# Seconds per stage at the default 480 s total (scaled with --budget-s): a stage stops repeating
# when its budget is spent and writes what it has; ~65 s are left for start-up and model building.
DEFAULT_BUDGET_S = 480.0
STAGE_SECONDS: dict[str, float] = {"peak": 15.0}
STEP_SECONDS = {"qwen2.5-0.5b": 60.0, "qwen2.5-1.5b": 80.0, "qwen3-4b": 140.0}
NUMERICS_SECONDS = {"qwen2.5-0.5b": 25.0, "qwen2.5-1.5b": 35.0, "qwen3-4b": 60.0}
OTHER_SHAPE_SECONDS = 30.0
STAGES = ("peak", "step", "numerics", "unsloth")

# The run's defaults (gateway.runs.config.RunConfig: loss "cispo", learning_rate 2e-5, LoRA r16 α32
# all-linear), restated: importing RunConfig would need pydantic, which the GPU machine lacks.
LEARNING_RATE = 2e-5
TRAINED_FRACTION = 0.5

# What the unsloth backend needs beyond the GPU machine's torch/transformers/peft/accelerate/
# safetensors, with the sizes of the cp312 manylinux x86_64 wheels of these versions on PyPI.
# unsloth + unsloth_zoo + bitsandbytes alone are over the 64 MiB that travels with the tree.
UNSLOTH_WHEELS: list[tuple[str, float]] = [
    ("unsloth-2026.10.9-py3-none-any.whl", 27.3),
    ("unsloth_zoo-2026.10.9-py3-none-any.whl", 2.8),
    ("bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl", 41.1),
    ("pyarrow-26.0.1-cp312-cp312-manylinux_2_28_x86_64.whl (for datasets)", 52.5),
    ("torchvision (the build matching the machine's torch 2.11 + CUDA 13)", 7.2),
    ("diffusers-0.42.1-py3-none-any.whl", 6.1),
    ("torchao-0.18.0-cp310-abi3-manylinux_2_24_x86_64.whl", 3.2),
    ("hf_transfer-0.1.9-cp38-abi3-manylinux_2_17_x86_64.whl", 3.4),
    ("sentencepiece-0.2.3-cp312-cp312-manylinux_2_27_x86_64.whl", 1.6),
    ("trl-1.16.0, datasets-5.2.0, tyro, msgspec, cut_cross_entropy, json5, structlog, typer, … (pure Python)", 3.0),
]
# The trainer's own imports beyond torch/transformers/peft (trainer.samples → gateway.store.tree →
# gateway.store.messages), with the wheel that provides each.
TRAINER_EXTRA_MODULES = {"orjson": "orjson-3.13.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl"}


# ---------------------------------------------------------------------------------------------
# The report: written whole after every measurement
# ---------------------------------------------------------------------------------------------


class Report:
    """Every figure so far, as ``gpu_check.json`` and ``gpu_check.md`` under ``out``. Each save
    replaces both files atomically, so a run killed at any point leaves the last complete state."""

    def __init__(self, out: Path, data: dict[str, Any]) -> None:
        self.out = out
        self.data = data
        self._lock = threading.Lock()
        out.mkdir(parents=True, exist_ok=True)

    @property
    def json_path(self) -> Path:
        return self.out / "gpu_check.json"

    @property
    def markdown_path(self) -> Path:
        return self.out / "gpu_check.md"

    def save(self) -> None:
        with self._lock:
            _write_atomic(self.json_path, json.dumps(self.data, indent=2, default=str))
            _write_atomic(self.markdown_path, render_markdown(self.data))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return f"{value:{spec}}{suffix}"


def render_markdown(data: dict[str, Any]) -> str:
    """The figures as the tables of docs/gpu.md and bench/README.md take them."""
    env = data.get("environment", {})
    lines = [
        f"# gpu_check: {env.get('device_name', '?')}",
        "",
        f"torch {env.get('torch')}, transformers {env.get('transformers')}, peft {env.get('peft')}, "
        f"Python {env.get('python')}; status: {data.get('status')}; {data.get('elapsed_s', 0):.0f} s",
        "",
    ]
    peak = data.get("peak")
    if peak:
        flops = peak.get("flops", 0.0)
        rate = f"{flops / 1e12:,.1f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:,.1f} GFLOP/s"
        lines += [f"Measured matmul peak: {rate} ({peak.get('what')})", ""]
    for backend, section in (("hf", data.get("step", {})), ("unsloth", data.get("unsloth", {}).get("step", {}))):
        if not section:
            continue
        lines += [
            f"## GRPO step ({backend} backend)",
            "",
            "| model | tokens/step | micro-batch | grad ckpt | step s | tokens/s | MFU | MFU of its work | peak GiB | "
            "bare s | step / bare | step, bf16 LM head s | note |",
            "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for shape, r in section.items():
            phases = r.get("phases", {})
            step, bare, bf16 = phases.get("step", {}), phases.get("bare", {}), phases.get("step_bf16_head", {})
            lines.append(
                f"| {shape} | {_fmt(r.get('tokens'), ',')} | {_fmt(r.get('micro_batch_tokens'), ',')} | "
                f"{'on' if r.get('gradient_checkpointing') else 'off'} | {_fmt(step.get('seconds'), '.3f')} | "
                f"{_fmt(step.get('tokens_per_s'), ',.0f')} | {_fmt(_pct(step.get('mfu')), '.1f', ' %')} | "
                f"{_fmt(_pct(step.get('mfu_work')), '.1f', ' %')} | "
                f"{_fmt(step.get('peak_gib'), '.2f')} | {_fmt(bare.get('seconds'), '.3f')} | "
                f"{_fmt(r.get('step_over_bare'), '.2f', '×')} | {_fmt(bf16.get('seconds'), '.3f')} | "
                f"{r.get('status', '')} |"
            )
        lines.append("")
    numerics = data.get("numerics", {})
    if numerics:
        lines += [
            "## Logprobs: bf16 on the device vs fp32 on the CPU (same weights, same batch)",
            "",
            "| model | positions | fp32 LM head: mean abs Δ | max abs Δ | bf16 LM head: mean abs Δ | max abs Δ "
            "| note |",
            "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for shape, r in numerics.items():
            f32, b16 = r.get("fp32_head", {}), r.get("bf16_head", {})
            lines.append(
                f"| {shape} | {_fmt(r.get('positions'), ',')} | {_fmt(f32.get('mean_abs'), '.2e')} | "
                f"{_fmt(f32.get('max_abs'), '.2e')} | {_fmt(b16.get('mean_abs'), '.2e')} | "
                f"{_fmt(b16.get('max_abs'), '.2e')} | {r.get('status', '')} |"
            )
        lines.append("")
    unsloth = data.get("unsloth")
    if unsloth:
        missing = f" ({'; '.join(unsloth['missing'])})" if unsloth.get("missing") else ""
        lines.append(f"unsloth: {unsloth.get('status')}{missing}")
        lines.append("")
    return "\n".join(lines)


def _pct(value: float | None) -> float | None:
    return None if value is None else 100.0 * value


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


class Clock:
    """The run's total deadline and each stage's: a stage ends at its own budget or the total's."""

    def __init__(self, budget_s: float) -> None:
        self.started = time.perf_counter()
        self.budget_s = budget_s
        self.scale = budget_s / DEFAULT_BUDGET_S

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def stage_deadline(self, seconds: float) -> float:
        """When a stage of ``seconds`` (at the default total) starting now must stop repeating."""
        return min(time.perf_counter() + seconds * self.scale, self.started + self.budget_s)


def log(clock: Clock, message: str) -> None:
    print(f"[{clock.elapsed():6.1f} s] {message}", flush=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    """Give freed tensors back (an OOM's traceback held them until its except block ended)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def peak_matmul(device: torch.device, dtype: torch.dtype, n: int, deadline: float) -> dict[str, Any]:
    """The best FLOP/s of a loop of ``n``³ GEMMs (10 per timing, one sync per timing, so launch gaps
    do not count), until 8 timings or the deadline: the denominator of MFU."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    inner = 10
    for _ in range(inner):  # warm-up: kernel selection, thread pool start, clocks up
        torch.matmul(a, b, out=c)
    synchronize(device)
    best = math.inf
    for timing in range(8):
        started = time.perf_counter()
        for _ in range(inner):
            torch.matmul(a, b, out=c)
        synchronize(device)
        best = min(best, (time.perf_counter() - started) / inner)
        if timing >= 1 and time.perf_counter() > deadline:
            break
    flops = 2 * n**3 / best
    return {"flops": flops, "tflops": flops / 1e12, "what": f"{str(dtype).removeprefix('torch.')} {n}³ GEMM"}


# ---------------------------------------------------------------------------------------------
# Models and rows
# ---------------------------------------------------------------------------------------------


def make_rows(count: int, length: int, vocab: int, shared_prefix: int, seed: int = 0) -> list[Row]:
    """``bench/trainer_step.py``'s synthetic rows: the last half of each row trained, behaviour
    logprobs near a random model's, a common prompt prefix."""
    from bench.trainer_step import synthetic_rows

    return synthetic_rows(count, length, vocab, TRAINED_FRACTION, seed=seed, shared_prefix=shared_prefix)


def decoder_tokens(batches: list[list[Row]], shared_prefix: int, sharing: bool) -> int:
    """Tokens the decoder actually runs: a micro-batch's shared prefix goes through it once
    (``HFBackend._final_hidden``)."""
    from trainer.backends.hf import MIN_SHARED_PREFIX

    total = 0
    for rows in batches:
        tokens = sum(len(r) for r in rows)
        if sharing and len(rows) > 1 and shared_prefix >= MIN_SHARED_PREFIX:
            tokens -= (len(rows) - 1) * min(shared_prefix, min(len(r) for r in rows) - 1)
        total += tokens
    return total


# ---------------------------------------------------------------------------------------------
# Stage: the GRPO step against a bare forward+backward
# ---------------------------------------------------------------------------------------------


def _timed(run: Callable[[], object], device: torch.device) -> tuple[float, float]:
    """Seconds (device work included) and peak memory of one call."""
    from bench.trainer_step import peak_memory

    with peak_memory(device) as mem:
        synchronize(device)
        started = time.perf_counter()
        run()
        synchronize(device)
        seconds = time.perf_counter() - started
    return seconds, mem["peak_bytes"]


def _attempts(micro_batch_tokens: int, row_tokens: int) -> list[tuple[int, bool]]:
    """What to try, in order, until a step fits: the asked micro-batch, halved down to one row, then
    one row with gradient checkpointing (which also turns prefix sharing off)."""
    sizes = [micro_batch_tokens]
    while sizes[-1] // 2 >= row_tokens:
        sizes.append(sizes[-1] // 2)
    return [(size, False) for size in sizes] + [(sizes[-1], True)]


def step_stage(
    backend_name: str,
    model_dir: Path,
    spec: dict[str, Any],
    args: argparse.Namespace,
    peak_flops: float | None,
    deadline: float,
    result: dict[str, Any],
    report: Report,
    clock: Clock,
) -> None:
    """Fill ``result`` with the step's and the bare pass's figures for one shape (saved as they come)."""
    from trainer.backends import LoraSpec, make_backend

    device = torch.device(args.device)
    rows = make_rows(args.rows, args.seq, spec["vocab_size"], args.shared_prefix)
    tokens = sum(len(r) for r in rows)
    result.update(tokens=tokens, rows=args.rows, seq=args.seq, shared_prefix=args.shared_prefix, attempts=[])
    for micro_batch_tokens, checkpointing in _attempts(args.micro_batch_tokens, args.seq):
        if result["attempts"] and time.perf_counter() > deadline:
            result["status"] = "OOM; the stage's budget was spent before a smaller attempt"
            return
        log(clock, f"  {backend_name}: micro-batch {micro_batch_tokens}, gradient checkpointing {checkpointing}")
        backend: TrainerBackend | None = None
        oom = None
        try:
            backend = make_backend(
                backend_name,  # type: ignore[arg-type]
                str(model_dir),
                LoraSpec(),
                LEARNING_RATE,
                device=args.device,
                dtype=args.dtype,
                gradient_checkpointing=checkpointing,
            )
            _measure(
                backend, rows, micro_batch_tokens, checkpointing, args, peak_flops, deadline, result, report, clock
            )
            return
        except torch.cuda.OutOfMemoryError as exc:  # torch.OutOfMemoryError, also before torch 2.5
            oom = str(exc).splitlines()[0][:300]
        finally:
            del backend
            release(device)
        attempt = {"micro_batch_tokens": micro_batch_tokens, "gradient_checkpointing": checkpointing, "oom": oom}
        result["attempts"].append(attempt)
        result["phases"] = {}
        result["status"] = "OOM at every attempt"
        report.save()
        log(clock, f"  out of memory: {oom}")


def _measure(
    backend: TrainerBackend,
    rows: list[Row],
    micro_batch_tokens: int,
    checkpointing: bool,
    args: argparse.Namespace,
    peak_flops: float | None,
    deadline: float,
    result: dict[str, Any],
    report: Report,
    clock: Clock,
) -> None:
    """Warm up each phase once, then alternate them (drift hits all alike) ``--repeats`` times or
    until the deadline; medians. An OOM propagates to ``step_stage``, which retries smaller."""
    from bench.trainer_step import bare_forward_backward
    from trainer.loss import LossConfig
    from trainer.samples import micro_batches

    device = backend.device
    check_base_dtype(backend, args.dtype)
    batches = micro_batches(rows, micro_batch_tokens)
    trained = sum(r.trainable_tokens for r in rows)
    tokens = sum(len(r) for r in rows)
    loss_config = LossConfig()  # the run's default objective (cispo)
    model = backend.model
    metrics: list[dict[str, float]] = []

    def bf16_head_step() -> None:
        default = backend.logprob_dtype  # type: ignore[attr-defined]
        backend.logprob_dtype = torch.bfloat16  # type: ignore[attr-defined]
        try:
            backend.train_step(rows, loss_config, micro_batch_tokens)
        finally:
            backend.logprob_dtype = default  # type: ignore[attr-defined]

    phases: dict[str, Callable[[], object]] = {
        "step": lambda: metrics.append(backend.train_step(rows, loss_config, micro_batch_tokens)),
        "bare": lambda: bare_forward_backward(backend, batches, trained),
    }
    if device.type == "cuda":  # on a CPU the bf16 matmul is the slow path: nothing to learn there
        phases["step_bf16_head"] = bf16_head_step
    times: dict[str, list[float]] = {name: [] for name in phases}
    peaks: dict[str, float] = {name: 0.0 for name in phases}
    for name, run in phases.items():
        log(clock, f"  warm-up: {name}")
        _timed(run, device)
    flops_per_token = backend.flops_per_token()
    # The step's own work: the decoder over the tokens it runs (a shared prefix once), the LM head
    # (a frozen linear: 4 FLOPs per weight) over the trained tokens only. The conventional MFU counts
    # every input token through both, as if logits were computed everywhere.
    head_flops = 4.0 * model.get_output_embeddings().weight.numel()
    # Only the hf backend's own pass shares (unsloth's replaces it), and by default only on the CPU.
    sharing = not checkpointing and backend.name == "hf" and bool(getattr(backend, "share_prefix", False))
    ran = decoder_tokens(batches, args.shared_prefix, sharing)
    work_flops = (flops_per_token - head_flops) * ran + head_flops * trained
    result.update(
        status="ok",
        backend=backend.name,
        micro_batch_tokens=micro_batch_tokens,
        micro_batches=len(batches),
        gradient_checkpointing=checkpointing,
        decoder_tokens=ran,
        trained_tokens=trained,
        dtype=args.dtype,
        logprob_dtype=str(backend.logprob_dtype).removeprefix("torch."),  # type: ignore[attr-defined]
        params=sum(p.numel() for p in model.parameters()),
        lora_params=sum(p.numel() for p in backend.trainable),
        flops_per_token=flops_per_token,
        work_flops=work_flops,
        objective=loss_config.kind,
    )
    for repeat in range(args.repeats):
        for name, run in phases.items():
            seconds, peak_bytes = _timed(run, device)
            times[name].append(seconds)
            peaks[name] = max(peaks[name], peak_bytes)
        result["phases"] = {
            name: _phase_figures(times[name], peaks[name], tokens, flops_per_token, work_flops, peak_flops)
            for name in phases
        }
        step, bare = result["phases"]["step"]["seconds"], result["phases"]["bare"]["seconds"]
        result["step_over_bare"] = step / bare
        result["step_over_bare_best"] = min(times["step"]) / min(times["bare"])
        last = metrics[-1]
        result["last_step"] = {k: last[k] for k in ("loss", "grad_norm", "ratio_mean", "tokens_per_s") if k in last}
        report.save()
        log(clock, f"  repeat {repeat + 1}: step {step:.3f} s, bare {bare:.3f} s, step/bare {step / bare:.2f}×")
        if time.perf_counter() > deadline:
            result["stopped"] = f"stage budget spent after {repeat + 1} repeat(s)"
            break


def _phase_figures(
    times: list[float],
    peak_bytes: float,
    tokens: int,
    flops_per_token: float,
    work_flops: float,
    peak_flops: float | None,
) -> dict[str, Any]:
    seconds = statistics.median(times)
    return {
        "seconds": seconds,
        "best_seconds": min(times),
        "times": times,
        "tokens_per_s": tokens / seconds,
        # The backend's honest LoRA count (4·N_frozen + 6·N_lora per token) over the input tokens.
        "mfu": None if peak_flops is None else flops_per_token * tokens / seconds / peak_flops,
        # The same for the step's own work (``work_flops``): how busy the device was, not how fast the step is.
        "mfu_work": None if peak_flops is None else work_flops / seconds / peak_flops,
        "peak_gib": peak_bytes / 2**30,
    }


# ---------------------------------------------------------------------------------------------
# Stage: numerics, bf16 on the device vs fp32 on the CPU
# ---------------------------------------------------------------------------------------------


def numerics_stage(model_dir: Path, spec: dict[str, Any], args: argparse.Namespace, result: dict[str, Any]) -> None:
    """The trainer's logprobs (``TrainerBackend.token_logprobs``: the chunked LM head, prefix sharing)
    of one fixed batch, bf16 on ``args.device`` with the default fp32 LM head and with a bf16 one,
    against fp32 on the CPU. The LoRA B matrices start at zero, so the adapter changes nothing and
    the three see the same function."""
    from trainer.backends import HFBackend, LoraSpec

    device = torch.device(args.device)
    rows = make_rows(2, args.numerics_seq, spec["vocab_size"], args.numerics_seq // 4, seed=1)
    reference = HFBackend(str(model_dir), LoraSpec(), LEARNING_RATE, device="cpu", dtype="float32")
    check_base_dtype(reference, "float32")
    expected = reference.token_logprobs(rows)
    del reference
    gc.collect()
    candidate = HFBackend(str(model_dir), LoraSpec(), LEARNING_RATE, device=args.device, dtype="bfloat16")
    check_base_dtype(candidate, "bfloat16")
    fp32_head = candidate.token_logprobs(rows)
    candidate.logprob_dtype = torch.bfloat16
    bf16_head = candidate.token_logprobs(rows)
    del candidate
    release(device)
    # Entry 0 of a row has no prediction (always 0.0); the rest are scored.
    reference_values = torch.tensor([v for row in expected for v in row[1:]], dtype=torch.float64)
    result.update(
        status="ok",
        device=f"bf16 on {device.type} vs fp32 on cpu",
        rows=len(rows),
        seq=args.numerics_seq,
        positions=reference_values.numel(),
        reference_mean_logprob=float(reference_values.mean()),
        fp32_head=_deltas(fp32_head, reference_values),
        bf16_head=_deltas(bf16_head, reference_values),
    )


def check_base_dtype(backend: TrainerBackend, expected: str) -> None:
    """Refuse to measure weights loaded in another dtype than asked: a transformers that ignores the
    backend's ``dtype=`` (older releases call it ``torch_dtype``) would load fp32 and every figure
    would describe the wrong run."""
    from trainer.backends.base import resolve_dtype

    frozen = next(p for p in backend.model.parameters() if not p.requires_grad)
    loaded = str(frozen.dtype).removeprefix("torch.")
    wanted = str(resolve_dtype(expected, frozen.device)).removeprefix("torch.")
    if loaded != wanted:
        raise RuntimeError(f"the base weights loaded as {loaded}, not {wanted}: the figures would describe another run")


def _deltas(logprobs: list[list[float]], reference: torch.Tensor) -> dict[str, float]:
    values = torch.tensor([v for row in logprobs for v in row[1:]], dtype=torch.float64)
    delta = (values - reference).abs()
    return {"mean_abs": float(delta.mean()), "max_abs": float(delta.max())}


# ---------------------------------------------------------------------------------------------
# Stage: unsloth
# ---------------------------------------------------------------------------------------------


def unsloth_stage(args: argparse.Namespace, peak_flops: float | None, clock: Clock, result: dict[str, Any]) -> None:
    """The step stage with the unsloth backend, in a child process (unsloth patches transformers and
    must be imported first), when this machine can run it; else what it lacks and what would travel."""
    from trainer.backends.unsloth import missing_requirements

    missing = missing_requirements()
    if missing:
        result.update(
            status="unavailable",
            missing=missing,
            wheels_needed=[{"wheel": name, "mib": mib} for name, mib in UNSLOTH_WHEELS],
            wheels_mib=round(sum(mib for _, mib in UNSLOTH_WHEELS), 1),
        )
        return
    child_out = args.out / "unsloth"
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--backend=unsloth",
        "--stages=step",
        f"--device={args.device}",
        f"--out={child_out}",
        f"--budget-s={max(clock.left() - 5, 1):.0f}",
        f"--shapes={','.join(args.shapes)}",
        f"--rows={args.rows}",
        f"--seq={args.seq}",
        f"--shared-prefix={args.shared_prefix}",
        f"--micro-batch-tokens={args.micro_batch_tokens}",
        f"--repeats={args.repeats}",
    ]
    if args.tiny:
        command.append("--tiny")
    if args.layers is not None:
        command.append(f"--layers={args.layers}")
    if peak_flops is not None:
        command.append(f"--peak-flops={peak_flops}")
    try:
        completed = subprocess.run(command, timeout=max(clock.left(), 1), check=False)
        result["returncode"] = completed.returncode
    except subprocess.TimeoutExpired:
        result["returncode"] = "timeout"
    child_json = child_out / "gpu_check.json"
    child = json.loads(child_json.read_text()) if child_json.is_file() else {}
    result["step"] = child.get("step", {})
    if any(shape.get("status") == "ok" for shape in result["step"].values()):
        result["status"] = "ran"
    else:
        result.update(status="error", error=f"the unsloth run measured no shape (exit {result['returncode']})")


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def use_wheels(directory: Path) -> list[str]:
    """Unpack every wheel in ``directory`` into a fresh folder put first on ``sys.path`` (and on
    ``PYTHONPATH``, for the unsloth child). The GPU machine has no network and may have no pip; a
    wheel is a zip of what an install would put in site-packages."""
    site = Path(tempfile.mkdtemp(prefix="gpu-check-site-"))
    names = []
    for wheel in sorted(directory.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)
        names.append(wheel.name)
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    importlib.invalidate_caches()
    return names


def environment(device: torch.device) -> dict[str, Any]:
    versions = {}
    for name in ("transformers", "peft", "accelerate", "safetensors"):
        try:
            versions[name] = importlib.import_module(name).__version__
        except ImportError:
            versions[name] = None
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        **versions,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "threads": torch.get_num_threads(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            cuda=torch.version.cuda, memory_gib=props.total_memory / 2**30, capability=f"{props.major}.{props.minor}"
        )
    return env


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="directory for gpu_check.json and gpu_check.md")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny Qwen2/Qwen3 models and rows: every stage in seconds")
    parser.add_argument("--shapes", help=f"comma list of {sorted(SHAPES)} or {sorted(TINY_SHAPES)}")
    parser.add_argument("--layers", type=int, help="override every shape's layer count (a quicker CPU check)")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma list of {STAGES}")
    parser.add_argument("--backend", choices=["hf", "unsloth"], default="hf", help="the step stage's backend")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="the whole run's seconds")
    parser.add_argument("--rows", type=int, help="rows per step (default 4)")
    parser.add_argument("--seq", type=int, help="tokens per row (default 4096; tiny 128)")
    parser.add_argument("--shared-prefix", type=int, help="leading tokens every row shares (default seq / 4)")
    parser.add_argument("--micro-batch-tokens", type=int, help="padded tokens per micro-batch (default 2 rows)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per phase, budget permitting")
    parser.add_argument("--numerics-seq", type=int, help="tokens per row of the numerics batch (default 512; tiny 64)")
    parser.add_argument("--dtype", help="the step's model dtype (default bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--wheels", type=Path, help="a folder of wheels to unpack onto sys.path first (orjson)")
    parser.add_argument("--peak-flops", type=float, help=argparse.SUPPRESS)  # the unsloth child gets the parent's
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch.cuda.is_available() is False (--device cpu --tiny checks the script)")
    args.shapes = (args.shapes or ",".join(TINY_SHAPES if args.tiny else GPU_SHAPES)).split(",")
    unknown = [s for s in args.shapes if s not in SHAPES and s not in TINY_SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}")
    args.stages = args.stages.split(",")
    if not set(args.stages) <= set(STAGES):
        parser.error(f"unknown stages {sorted(set(args.stages) - set(STAGES))}")
    args.rows = args.rows or 4
    args.seq = args.seq or (128 if args.tiny else 4096)
    args.shared_prefix = args.seq // 4 if args.shared_prefix is None else args.shared_prefix
    args.micro_batch_tokens = args.micro_batch_tokens or 2 * args.seq
    args.numerics_seq = args.numerics_seq or (64 if args.tiny else 512)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the stages; 0 when every stage ran (out-of-memory attempts included), 1 when one failed,
    2 when the trainer cannot even be imported (a wheel is missing: the report says which), 3 when
    the total budget ran out (``_expire``)."""
    args = parse_args(argv)
    if args.backend == "unsloth" and importlib.util.find_spec("unsloth") is not None:
        import unsloth  # noqa: F401  # before transformers, so that its patches apply

    clock = Clock(args.budget_s)
    device = torch.device(args.device)
    wheels = use_wheels(args.wheels) if args.wheels else []
    report = Report(
        args.out,
        {
            "issue": 36,
            "status": "running",
            "argv": sys.argv[1:] if argv is None else argv,
            "budget_s": args.budget_s,
            "environment": environment(device),
            "wheels_unpacked": wheels,
            "settings": {
                k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in ("wheels", "out")
            },
        },
    )
    missing = {m: wheel for m, wheel in TRAINER_EXTRA_MODULES.items() if importlib.util.find_spec(m) is None}
    if missing:
        report.data.update(status="missing modules", missing_modules=missing)
        report.save()
        log(clock, f"the trainer imports {sorted(missing)}: bring {sorted(missing.values())} with --wheels DIR")
        return 2
    report.save()
    log(clock, f"{report.data['environment']['device_name']}: stages {args.stages}, shapes {args.shapes}")
    # What is left, not the whole budget: start-up (imports, device probing) already spent some of it.
    watchdog = threading.Timer(max(clock.left(), 0.0), _expire, args=(report, clock))
    watchdog.daemon = True
    watchdog.start()

    failed = False
    peak_flops = args.peak_flops
    if "peak" in args.stages:
        failed |= _stage(report, clock, "peak", None, STAGE_SECONDS["peak"], lambda r: _peak_stage(args, clock, r))
        peak_flops = report.data["peak"].get("flops", peak_flops)
    for name in args.shapes:
        if not {"step", "numerics"} & set(args.stages):
            break
        spec = shape_spec(name, args.layers)
        with tempfile.TemporaryDirectory(prefix=f"gpu-check-{name}-") as tmp:
            model_dir = Path(tmp)
            log(clock, f"{name}: building random weights")
            # bf16: what vLLM serves; the numerics stage's fp32 reference upcasts the same values.
            params = build_random_model(spec, model_dir, device, torch.bfloat16, tokenizer=args.backend == "unsloth")
            release(device)
            log(clock, f"{name}: {params / 1e6:,.1f}M parameters")
            if "step" in args.stages:
                budget = STEP_SECONDS.get(name, OTHER_SHAPE_SECONDS)
                deadline = clock.stage_deadline(budget)
                failed |= _stage(
                    report,
                    clock,
                    "step",
                    name,
                    budget,
                    lambda r: step_stage(args.backend, model_dir, spec, args, peak_flops, deadline, r, report, clock),
                )
            if "numerics" in args.stages:
                budget = NUMERICS_SECONDS.get(name, OTHER_SHAPE_SECONDS)
                failed |= _stage(
                    report, clock, "numerics", name, budget, lambda r: numerics_stage(model_dir, spec, args, r)
                )
    if "unsloth" in args.stages:
        failed |= _stage(report, clock, "unsloth", None, 0.0, lambda r: unsloth_stage(args, peak_flops, clock, r))
    watchdog.cancel()
    if clock.left() <= 0:  # the stages ended by skipping, before the watchdog's thread got its turn
        _expire(report, clock, exit_process=False)
        return 3
    report.data.update(status="failed" if failed else "done", elapsed_s=clock.elapsed())
    report.save()
    log(clock, f"{report.data['status']}: {report.json_path}, {report.markdown_path}")
    return 1 if failed else 0


def _peak_stage(args: argparse.Namespace, clock: Clock, result: dict[str, Any]) -> None:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype in ("bfloat16", "bf16") else torch.float32
    n = 8192 if device.type == "cuda" else (512 if args.tiny else 2048)
    result.update(peak_matmul(device, dtype, n, clock.stage_deadline(STAGE_SECONDS["peak"])))
    result["status"] = "ok"


def _stage(
    report: Report,
    clock: Clock,
    stage: str,
    shape: str | None,
    budget_s: float,
    run: Callable[[dict[str, Any]], None],
) -> bool:
    """Run one stage into its place in the report. A stage is skipped when less than half its budget
    (``budget_s`` at the default total, scaled) is left of the total: better a later stage's figures
    than a stage cut off midway. One that raises is recorded and the rest still run. Returns whether
    it failed."""
    section: dict[str, Any] = {}
    if shape is None:
        report.data[stage] = section
    else:
        report.data.setdefault(stage, {})[shape] = section
    label = stage if shape is None else f"{stage} {shape}"
    if clock.left() <= 0.5 * budget_s * clock.scale:
        section["status"] = f"skipped: {max(clock.left(), 0):.0f} s of the total left"
        report.save()
        log(clock, f"{label}: {section['status']}")
        return False
    log(clock, f"{label}: start")
    try:
        run(section)
    except Exception as exc:  # noqa: BLE001  # one stage's failure must not cost the others' figures
        error = f"{type(exc).__name__}: {exc}"[:500]
        section.update(status="error", error=error, traceback=traceback.format_exc()[-3000:])
        log(clock, f"{label}: {section['error']}")
        release(torch.device(report.data["environment"]["device"]))
    report.data["elapsed_s"] = clock.elapsed()
    report.save()
    log(clock, f"{label}: {section.get('status')}")
    return section.get("status") == "error"


def _expire(report: Report, clock: Clock, exit_process: bool = True) -> None:
    """The total budget is spent: keep what was saved, mark it, and (from the watchdog) stop at once."""
    try:
        report.data.update(status="stopped: total budget spent", elapsed_s=clock.elapsed())
        report.save()  # may meet the main thread mid-update: the last complete save then stands
        log(clock, "total budget spent: stopping; the figures so far are in the report")
    finally:
        if exit_process:
            os._exit(3)


if __name__ == "__main__":
    sys.exit(main())
