"""What a GRPO step costs against a bare forward+backward of the same tokens, and the MFU: one run, one table.

Measured in the same run (docs/design.md §14):
  * the machine's peak matmul FLOP/s: a large GEMM repeated, best of the runs (fp32 2048³ on CPU,
    bf16 8192³ on CUDA — the dtype the model trains in);
  * a model: random-init weights shaped like SmolLM2-135M (`--shape 135m`, default) or Qwen2.5-0.5B
    (`--shape 0.5b`), or a real one (`--model DIR`), with the default LoRA of docs/objectives.md §6 (r 16, α 32, all linear);
  * synthetic rows (default 8 × 512 tokens on CPU, 16 × 1024 on CUDA; the second half of each row
    trained, `--trained-fraction`), split with the trainer's own micro-batching;
  * (a) bare: forward + backward of those micro-batches with plain cross-entropy on full logits,
    LoRA attached, no optimizer — the floor any trainer pays;
  * (b) step: `trainer.step.train_step` (what `TrainerBackend.train_step` runs) with CISPO: chunked
    LM-head logprobs, the objective, backward, grad clip, AdamW.
One warm-up of each, then (a) and (b) alternate `--repeats` times (drift hits both alike); medians.
Reports tokens/s, the step/bare time ratio (target ≤ 1.5), MFU = flops_per_token · tokens / time /
peak (the backend's honest LoRA count, 4·N_frozen + 6·N_lora; the 6·N convention is shown beside it)
and peak memory (RSS sampled during each phase on CPU; CUDA max allocated on GPU).

    .venv/bin/python bench/trainer_step.py --quick        # CPU, 8 of 30 layers, ~2-3 min on 2 cores
    .venv/bin/python bench/trainer_step.py                # CPU, the full 135M shape, ~5 min on 2 cores
    python bench/trainer_step.py --device cuda --shape 0.5b [--backend unsloth]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.random_models import build_random_model, shape_spec  # noqa: E402
from trainer.backends import LoraSpec, TrainerBackend, make_backend  # noqa: E402
from trainer.loss import LossConfig  # noqa: E402
from trainer.samples import Row, collate, micro_batches  # noqa: E402

TARGET_RATIO = 1.5

# --shape -> the public config it builds with random weights (bench/random_models.py), which costs the same.
SHAPES = {"135m": "smollm2-135m", "0.5b": "qwen2.5-0.5b"}
QUICK_LAYERS = 8


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_matmul_flops(device: torch.device, quick: bool) -> tuple[float, str]:
    """Best FLOP/s of a square GEMM in the dtype the model trains in on this device."""
    if device.type == "cuda":
        n, dtype, repeats = 8192, torch.bfloat16, 20
    else:
        n, dtype, repeats = 2048, torch.float32, 4 if quick else 8
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up: kernel selection, thread pool start
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    return 2 * n**3 / best, f"{str(dtype).removeprefix('torch.')} {n}³ GEMM"


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextmanager
def peak_memory(device: torch.device) -> Iterator[dict[str, float]]:
    """Peak memory while the block runs: CUDA max allocated, or RSS sampled every 5 ms on CPU."""
    result: dict[str, float] = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        yield result
        result["peak_bytes"] = float(torch.cuda.max_memory_allocated(device))
        return
    peak = _rss_bytes()
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.wait(0.005):
            peak = max(peak, _rss_bytes())

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield result
    finally:
        stop.set()
        thread.join()
        result["peak_bytes"] = float(max(peak, _rss_bytes()))


# ---------------------------------------------------------------------------------------------
# The model and the rows
# ---------------------------------------------------------------------------------------------


def synthetic_rows(
    count: int, length: int, vocab: int, trained_fraction: float, seed: int = 0, shared_prefix: int = 0
) -> list[Row]:
    """Random ids; the first part context (mask 0), the last ``trained_fraction`` trained; behaviour
    logprobs near a random model's (≈ −log V), so ratios are near 1 as on-policy; advantages ±1.
    The first ``shared_prefix`` ids are the same in every row, as an agent's system prompt is."""
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(shared_prefix)]
    context = max(1, round(length * (1 - trained_fraction)))  # position 0 is never trained
    uniform = -math.log(vocab)
    rows = []
    for i in range(count):
        ids = (prefix + [rng.randrange(vocab) for _ in range(length)])[:length]
        mask = [0] * context + [1] * (length - context)
        behaviour = [uniform + rng.uniform(-0.1, 0.1) if m else 0.0 for m in mask]
        rows.append(Row(ids, mask, behaviour, 1.0 if i % 2 == 0 else -1.0, f"t{i}", f"g{i // 4}", sequence_id=i))
    return rows


def bare_forward_backward(backend: TrainerBackend, batches: list[list[Row]], total_tokens: int) -> None:
    """The floor: the model's own forward (full logits), cross-entropy on the trained targets,
    backward; same micro-batches and normalisation as the step, no optimizer."""
    model = backend.model  # type: ignore[attr-defined]
    model.train()
    for rows in batches:
        batch = {k: v.to(backend.device) for k, v in collate(rows).items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        nll = F.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), batch["input_ids"][:, 1:].flatten(), reduction="none"
        )
        loss = (nll * batch["loss_mask"][:, 1:].flatten()).sum() / total_tokens
        loss.backward()
    model.zero_grad(set_to_none=True)
    synchronize(backend.device)


@dataclass
class Phase:
    name: str
    run: Callable[[], object]
    device: torch.device
    times: list[float] = field(default_factory=list)
    peak_bytes: float = 0.0

    def once(self) -> None:
        with peak_memory(self.device) as mem:
            started = time.perf_counter()
            self.run()
            self.times.append(time.perf_counter() - started)
        self.peak_bytes = max(self.peak_bytes, mem["peak_bytes"])


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a local model directory (default: random weights of --shape)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="135m")
    parser.add_argument("--layers", type=int, help="override the shape's layer count")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_LAYERS} layers, fewer GEMM repeats")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--backend", choices=["hf", "unsloth"], default="hf")
    parser.add_argument("--rows", type=int, help="rows per step (default 8 on CPU, 16 on CUDA)")
    parser.add_argument("--seq", type=int, help="tokens per row (default 512 on CPU, 1024 on CUDA)")
    parser.add_argument(
        "--trained-fraction", type=float, default=0.5, help="share of each row's tokens trained (mask 1)"
    )
    parser.add_argument(
        "--micro-batch-tokens", type=int, help="padded tokens per micro-batch (default: all rows in one)"
    )
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="leading tokens every row shares (an agent's prompt); adds the step with prefix sharing off beside it",
    )
    parser.add_argument(
        "--logprob-dtype",
        default="float32",
        help="the LM-head matmul's dtype in the step (bfloat16 is much faster on GPUs)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write every figure here too")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch.cuda.is_available() is False")
    cuda = device.type == "cuda"
    rows_per_step = args.rows or (16 if cuda else 8)
    seq = args.seq or (1024 if cuda else 512)
    mbt = args.micro_batch_tokens or rows_per_step * seq
    layers = args.layers or (QUICK_LAYERS if args.quick else None)
    dtype = torch.bfloat16 if cuda else torch.float32

    peak_before, peak_what = peak_matmul_flops(device, args.quick)
    print(
        f"peak matmul: {peak_before / 1e9:,.1f} GFLOP/s ({peak_what}) on {device}, {torch.get_num_threads()} threads",
        flush=True,
    )

    with tempfile.TemporaryDirectory(prefix="trainer-bench-") as tmp:
        if args.model:
            model_dir, what = args.model, args.model
        else:
            model_dir = tmp
            spec = shape_spec(SHAPES[args.shape], layers)
            build_random_model(spec, Path(tmp), torch.device("cpu"), dtype, tokenizer=args.backend == "unsloth")
            what = f"random {args.shape} shape" + (f", {layers} layers" if layers else "")
        backend = make_backend(
            args.backend,
            model_dir,
            LoraSpec(),
            1e-5,
            device=args.device,
            dtype=str(dtype).removeprefix("torch."),
            gradient_checkpointing=args.gradient_checkpointing,
            logprob_dtype=args.logprob_dtype,
        )

    model = backend.model  # type: ignore[attr-defined]
    config = model.get_base_model().config
    params = sum(p.numel() for p in model.parameters())
    lora_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    rows = synthetic_rows(rows_per_step, seq, config.vocab_size, args.trained_fraction, shared_prefix=args.shared_prefix)
    batches = micro_batches(rows, mbt)
    total_trainable = sum(r.trainable_tokens for r in rows)
    tokens = sum(len(r) for r in rows)
    flops_per_token = backend.flops_per_token()
    # The 6·N convention of docs/design.md §14: N = all parameters (embedding included), as if every
    # weight got a gradient.
    flops_6n = 6.0 * params

    step_metrics: list[dict[str, float]] = []
    phases = [
        Phase(
            "bare fwd+bwd (full-logits CE)", lambda: bare_forward_backward(backend, batches, total_trainable), device
        ),
        Phase(
            f"GRPO train_step (cispo, {backend.name})",
            lambda: step_metrics.append(backend.train_step(rows, LossConfig(kind="cispo"), mbt)),
            device,
        ),
    ]
    if args.shared_prefix:

        def unshared_step() -> None:
            backend.share_prefix = False  # type: ignore[attr-defined]
            try:
                backend.train_step(rows, LossConfig(kind="cispo"), mbt)
            finally:
                backend.share_prefix = True  # type: ignore[attr-defined]

        phases.append(Phase("the same step, prefix not shared", unshared_step, device))
    print(
        f"model: {what} ({params / 1e6:.1f}M params, LoRA {lora_params / 1e6:.2f}M), "
        f"{rows_per_step} rows × {seq} tokens, {len(batches)} micro-batch(es) of ≤ {mbt} tokens; warm-up…",
        flush=True,
    )
    for phase in phases:
        phase.once()
        phase.times.clear()  # the warm-up is not measured
    for _ in range(args.repeats):
        for phase in phases:
            phase.once()

    # Measured again after the model phases; the better of the two is the machine's peak, so a
    # burst of other load during one measurement does not inflate every MFU.
    peak_after, _ = peak_matmul_flops(device, args.quick)
    peak = max(peak_before, peak_after)
    load = os.getloadavg()[0]
    results = []
    for phase in phases:
        seconds = statistics.median(phase.times)
        results.append(
            dict(
                phase=phase.name,
                seconds=seconds,
                best_seconds=min(phase.times),
                tokens_per_s=tokens / seconds,
                mfu=flops_per_token * tokens / seconds / peak,
                mfu_6n=flops_6n * tokens / seconds / peak,
                peak_memory_gib=phase.peak_bytes / 2**30,
                times=phase.times,
            )
        )
    ratio = results[1]["seconds"] / results[0]["seconds"]
    # On a shared machine one slow repeat can dominate a median of 3; the best times estimate the
    # intrinsic cost and are shown beside it.
    best_ratio = results[1]["best_seconds"] / results[0]["best_seconds"]

    memory = "peak CUDA alloc" if cuda else "peak RSS"
    print()
    print(f"| phase | s/step (median of {args.repeats}) | best | tokens/s | MFU | MFU (6·N convention) | {memory} |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(
            f"| {r['phase']} | {r['seconds']:.2f} | {r['best_seconds']:.2f} | {r['tokens_per_s']:,.0f} | "
            f"{100 * r['mfu']:.1f} % | {100 * r['mfu_6n']:.1f} % | {r['peak_memory_gib']:.2f} GiB |"
        )
    if args.shared_prefix:
        print(
            f"\n{args.shared_prefix} of {seq} tokens shared by every row: the step takes "
            f"{results[1]['seconds'] / results[2]['seconds']:.2f}× the time and "
            f"{results[1]['peak_memory_gib'] / results[2]['peak_memory_gib']:.2f}× the memory of the unshared step"
        )
    verdict = "PASS" if ratio <= TARGET_RATIO else "MISS"
    print(f"\nstep / bare = {ratio:.2f}× (target ≤ {TARGET_RATIO}×): {verdict}; best / best = {best_ratio:.2f}×")
    print(
        f"flops/token: {flops_per_token / 1e6:.1f} M (4·N_frozen_linear + 6·N_lora); 6·N: {flops_6n / 1e6:.1f} M; "
        f"{tokens} tokens/step ({total_trainable} trained)"
    )
    print(
        f"peak {peak / 1e9:,.1f} GFLOP/s (before {peak_before / 1e9:,.1f}, after {peak_after / 1e9:,.1f}); "
        f"1-min load average at the end {load:.2f}"
    )
    if not cuda and load > torch.get_num_threads() + 0.5:
        print(
            "warning: other processes competed for the CPU; absolute figures and MFU are pessimistic, rerun when quiet"
        )
    last = step_metrics[-1]
    print(
        f"last step: loss {last['loss']:.4f}, grad_norm {last['grad_norm']:.3f}, "
        f"ratio_mean {last['ratio_mean']:.4f}, clip_frac {last['clip_frac']:.3f}"
    )

    if args.json:
        args.json.write_text(
            json.dumps(
                dict(
                    device=str(device),
                    threads=torch.get_num_threads(),
                    peak_flops=peak,
                    peak_flops_before=peak_before,
                    peak_flops_after=peak_after,
                    peak_what=peak_what,
                    load_average=load,
                    model=what,
                    params=params,
                    lora_params=lora_params,
                    rows=rows_per_step,
                    seq=seq,
                    micro_batch_tokens=mbt,
                    shared_prefix=args.shared_prefix,
                    flops_per_token=flops_per_token,
                    results=results,
                    ratio=ratio,
                    best_ratio=best_ratio,
                    target_ratio=TARGET_RATIO,
                    last_step=last,
                ),
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
