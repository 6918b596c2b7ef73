"""Each objective on on-policy data from real vLLM CPU (SmolLM2-135M, temperature 1, the bf16 weights vLLM serves
loaded in fp32 by the hf backend): one step trains (a non-zero gradient), and on that fresh data the trainer's
policy is vLLM's up to numerics — small |log ratio|, ratio ≈ 1, little clipping, KL ≈ 0.

Rewards are by sample index (bench/objectives.py), so no verdict depends on what the model writes; only the
numeric agreement of two implementations of the same weights is asserted. bench/objectives.py measures the same
figures over several steps, with the trained adapters served by vLLM."""

from __future__ import annotations

import pytest

from bench.objectives import OBJECTIVES, PROMPTS, on_policy_rows, sample_groups
from trainer.backends import HFBackend, LoraSpec
from trainer.demo.vllm_cpu import ensure_smollm2
from trainer.samples import Row

# Bounds: about twice what bench/objectives.py measured on this setup at temperature 1 (4 prompts × 4 samples, ≤ 24
# tokens, base weights): mean |log ratio| 0.039, ratio mean 0.9977, k3 KL 1.4e-3, token ratios within 0.84..1.17
# (so PPO's 0.8..1.28 clipped nothing and no IS weight reached the cap of 2).
LOG_RATIO_ABS_MEAN_BOUND = 0.08
RATIO_MEAN_BOUND = 0.02
APPROX_KL_BOUND = 5e-3
CLIP_FRAC_BOUND = 0.02
MEASURED = ("grad_norm", "log_ratio_abs_mean", "ratio_mean", "ratio_min", "ratio_max", "clip_frac", "tis_frac", "approx_kl")


@pytest.fixture(scope="module")
def rows(vllm_base_url: str, vllm_model_name: str) -> list[Row]:
    groups = sample_groups(vllm_base_url, vllm_model_name, PROMPTS[:2], max_tokens=12, temperature=1.0)
    sampled = on_policy_rows(groups)
    assert len(sampled) == 8 and all(row.advantage != 0 for row in sampled)
    return sampled


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_one_step_of_each_objective_trains_on_fresh_vllm_data(rows: list[Row], name: str) -> None:
    backend = HFBackend(str(ensure_smollm2()), LoraSpec(), 1e-4, device="cpu")
    metrics = backend.train_step(rows, OBJECTIVES[name], micro_batch_tokens=4096)
    print(f"{name}: " + ", ".join(f"{k} {metrics[k]:.3g}" for k in MEASURED if k in metrics))

    assert metrics["grad_norm"] > 0.01
    assert metrics["log_ratio_abs_mean"] < LOG_RATIO_ABS_MEAN_BOUND
    assert abs(metrics["ratio_mean"] - 1) < RATIO_MEAN_BOUND
    assert metrics["approx_kl"] < APPROX_KL_BOUND
    if name in ("gspo", "grpo+tis"):
        # The ratio is against the trainer's own π_old (1 in value): nothing can be clipped. The old GSPO, with
        # its ratio against vLLM's logprobs, clipped every sequence whose noise pointed the way of its advantage.
        assert metrics["clip_frac"] == 0.0
        assert metrics["tis_frac"] == 0.0
    else:
        assert metrics["clip_frac"] < CLIP_FRAC_BOUND
