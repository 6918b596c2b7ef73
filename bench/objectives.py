"""How far is the trainer's policy from the one vLLM sampled, per objective, step after step? One table.

For each objective (grpo, cispo, gspo, grpo + TIS) a fresh LoRA adapter on SmolLM2-135M (the bf16 weights vLLM
serves, trained in fp32 on CPU) runs `--steps` steps of the real loop without the gateway: sample on-policy from
vLLM CPU (the base model for step 1, then the adapter the previous step saved, loaded into vLLM as `kind@step`),
at `--temperature` (1.0: vLLM's logprobs are raw, so only then is the behaviour policy the model's distribution),
with content-blind rewards (by sample index: the figures must not depend on what the model writes), then one
optimizer step. Reported per step, on that fresh data before the update: the token-weighted mean |logπ_θ −
logπ_vllm| (`log_ratio_abs_mean`), the ratio mean, clip fraction, IS-capped share and k3 KL, and what GSPO as it
was (its ratio exp(mean_t log r) against vLLM, the paper's clip 1 − 3e-4 .. 1 + 4e-4) would have done: the share of
sequences outside that range, and of those it clipped to zero gradient.

    .venv/bin/python bench/objectives.py                         # starts vLLM CPU itself, ~5 min on 2 cores
    .venv/bin/python bench/objectives.py --base-url http://127.0.0.1:8000/v1 --steps 3 --temperature 0.7
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere, like the other benchmarks
    sys.path.insert(0, str(REPO))

from trainer.backends import HFBackend, LoraSpec  # noqa: E402
from trainer.demo.vllm_cpu import ensure_smollm2, smollm2_server  # noqa: E402
from trainer.loss import LossConfig  # noqa: E402
from trainer.samples import CallData, GroupData, Row, TrajectoryData, build_samples  # noqa: E402
from trainer.worker.publish import VllmAdmin  # noqa: E402

PROMPTS = ["Name a colour.", "Say a number between one and ten.", "Name an animal.", "Name a fruit."]
REWARDS = [1.0, 0.0, 0.5, 0.25]  # by sample index: an advantage spread whatever the model writes

OBJECTIVES: dict[str, LossConfig] = {
    "grpo": LossConfig(kind="grpo"),
    "cispo": LossConfig(kind="cispo"),
    "gspo": LossConfig(kind="gspo"),
    "grpo+tis": LossConfig(kind="grpo", tis_cap=2.0),
}


def _post(base_url: str, path: str, body: dict[str, Any], timeout_s: float = 300.0) -> dict[str, Any]:
    request = urllib.request.Request(
        base_url.rstrip("/") + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def sample_groups(
    base_url: str,
    model: str,
    prompts: Sequence[str] = PROMPTS,
    *,
    n: int = len(REWARDS),
    max_tokens: int = 16,
    temperature: float = 1.0,
    seed: int = 0,
) -> list[GroupData]:
    """One group per prompt: ``n`` samples of one chat request, with vLLM's token ids and logprobs
    exactly as the gateway records them, rewarded by sample index (``REWARDS``)."""
    groups = []
    for p, prompt in enumerate(prompts):
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "n": n,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "seed": seed * 1000 + p,
            "logprobs": True,
            "return_token_ids": True,
        }
        response = _post(base_url, "/chat/completions", body)
        trajectories = [
            TrajectoryData(
                trajectory_id=f"{p}-{choice['index']}",
                reward=REWARDS[choice["index"] % len(REWARDS)],
                calls=[
                    CallData(
                        seq=0,
                        choice_index=0,  # each sample is its own trajectory
                        policy_version=0,
                        prompt_token_ids=response["prompt_token_ids"],
                        completion_token_ids=choice["token_ids"],
                        completion_logprobs=[entry["logprob"] for entry in choice["logprobs"]["content"]],
                        trainable=True,
                    )
                ],
            )
            for choice in response["choices"]
        ]
        groups.append(GroupData(group_id=f"prompt-{p}", trajectories=trajectories))
    return groups


def on_policy_rows(groups: list[GroupData]) -> list[Row]:
    return build_samples(groups, advantage_mode="group", drop_zero_variance=True, max_seq_len=2048).rows


def old_gspo_shares(rows: Sequence[Row], trainer_logprobs: Sequence[Sequence[float]]) -> tuple[float, float]:
    """GSPO as it was, with s = exp(mean_t (logπ_θ − logπ_vllm)) and the paper's clip 1 − 3e-4 .. 1 + 4e-4:
    the share of sequences with s outside that range, and of those it clipped to no gradient (outside on the
    side their advantage points to)."""
    outside = clipped = 0
    for row, lps in zip(rows, trainer_logprobs, strict=True):
        diffs = [lp - blp for lp, blp, m in zip(lps, row.behaviour_logprobs, row.loss_mask, strict=True) if m]
        s = math.exp(sum(diffs) / len(diffs))
        outside += not (1 - 3e-4 <= s <= 1 + 4e-4)
        clipped += (row.advantage > 0 and s > 1 + 4e-4) or (row.advantage < 0 and s < 1 - 3e-4)
    return outside / len(rows), clipped / len(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", help="a running vLLM serving SmolLM2 as `smollm2` with --enable-lora")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--json", type=Path, help="write every figure here too")
    args = parser.parse_args()
    if args.base_url:
        return _measure(args, args.base_url)
    with smollm2_server() as server:
        return _measure(args, server.base_url)


def _measure(args: argparse.Namespace, base_url: str) -> int:
    weights = ensure_smollm2()
    admin = VllmAdmin(base_url)
    results = []
    with tempfile.TemporaryDirectory(prefix="objectives-") as tmp:
        for name, config in OBJECTIVES.items():
            backend = HFBackend(str(weights), LoraSpec(), args.lr, device="cpu", seed=0)
            served = name.replace("+", "-")
            model = "smollm2"
            for step in range(1, args.steps + 1):
                rows = on_policy_rows(
                    sample_groups(base_url, model, max_tokens=args.max_tokens, temperature=args.temperature, seed=step)
                )
                outside, clipped = old_gspo_shares(rows, backend.token_logprobs(rows))
                metrics = backend.train_step(rows, config, micro_batch_tokens=4096)
                results.append(
                    {**metrics, "objective": name, "step": step, "old_gspo_outside": outside, "old_gspo_clipped": clipped}
                )
                model = f"{served}@{step}"
                backend.save(Path(tmp) / model)
                admin.load(model, Path(tmp) / model)
            for step in range(1, args.steps + 1):
                admin.unload(f"{served}@{step}")

    print(f"\ntemperature {args.temperature}, lr {args.lr}, {len(PROMPTS)} prompts × {len(REWARDS)} samples ≤ "
          f"{args.max_tokens} tokens per step; metrics on each step's fresh data, before its update\n")  # fmt: skip
    print("| objective | step | trained tokens | mean abs log ratio | ratio mean | clip frac | IS capped | approx KL "
          "| grad norm | old GSPO: seqs outside clip / clipped |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        capped = f"{r['tis_frac']:.3f}" if "tis_frac" in r else "–"
        print(
            f"| {r['objective']} | {r['step']} | {r['tokens']:.0f} | {r['log_ratio_abs_mean']:.4f} | "
            f"{r['ratio_mean']:.4f} | {r['clip_frac']:.3f} | {capped} | {r['approx_kl']:.2e} | {r['grad_norm']:.3f} | "
            f"{r['old_gspo_outside']:.0%} / {r['old_gspo_clipped']:.0%} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
