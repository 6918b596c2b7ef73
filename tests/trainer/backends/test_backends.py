"""The hf backend on a tiny random Llama built here (CPU, fp32, no downloads); unsloth's refusal on CPU."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tests.support.tiny_models import (
    FFN,
    HIDDEN,
    LAYERS,
    PATTERN,
    VOCAB,
    build_tiny_llama,
    make,
    mixed_rows,
    row,
    set_behaviour,
)
from trainer.backends import HFBackend, LoraSpec, UnslothBackend, make_backend, resolve_backend_name
from trainer.backends.hf import check_logprob_support
from trainer.lora import check_vllm_adapter
from trainer.loss import LossConfig, StepTotals, policy_loss
from trainer.samples import Row, collate
from trainer.step import make_optimizer, train_step


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def count_forward_calls(module: nn.Module) -> list[int]:
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def full_logits_logprobs(model: nn.Module, r: Row) -> list[float]:
    """Reference: full-vocabulary logits → log_softmax → the logprob of each next token."""
    ids = torch.tensor([r.input_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)
    return [0.0] + logprobs[0, :-1].gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()


# ------------------------------------------------------------------------------------ the step


def test_on_policy_first_step_has_ratio_one_and_nothing_clipped(tiny: str) -> None:
    backend = make(tiny)
    merged = row([5, 6, 7], [8, 9, 10], 1.0, 6)  # a merged multi-turn row: trained spans with context between
    merged.input_ids += [11, 12, 13, 14]
    merged.loss_mask += [0, 0, 1, 1]
    merged.behaviour_logprobs += [0.0] * 4
    rows = set_behaviour(backend, [*mixed_rows(), merged])
    calls: list[tuple[int, int]] = []
    # A budget that forces several padded micro-batches, grouped unlike token_logprobs' batches.
    metrics = backend.train_step(
        rows, LossConfig(kind="grpo"), micro_batch_tokens=24, progress=lambda d, t: calls.append((d, t))
    )
    assert abs(metrics["ratio_mean"] - 1) < 1e-4
    assert abs(metrics["ratio_max"] - 1) < 1e-5 and abs(metrics["ratio_min"] - 1) < 1e-5  # measured ±1.5e-6
    assert metrics["clip_frac"] == 0.0
    assert metrics["approx_kl"] < 1e-8
    assert metrics["log_ratio_abs_mean"] < 2e-6  # measured ~3e-7: same weights, recomputed
    n = int(metrics["micro_batches"])
    assert n > 1 and calls == [(i, n) for i in range(1, n + 1)]
    assert metrics["tokens"] == sum(r.trainable_tokens for r in rows)
    assert metrics["input_tokens"] == sum(len(r) for r in rows) <= metrics["padded_tokens"]
    assert metrics["grad_norm"] > 0 and math.isfinite(metrics["loss"])
    assert metrics["step"] == 1 and backend.step == 1
    assert metrics["tokens_per_s"] == pytest.approx(metrics["input_tokens"] / metrics["seconds"])


def test_learning_raises_the_rewarded_pattern(tiny: str) -> None:
    """Groups where completions repeating token 7 get reward 1 and others 0: a few on-policy CISPO
    steps raise the logprob of the pattern and lower the others'."""
    backend = make(tiny, lr=1e-2)
    rng = random.Random(1)
    rows: list[Row] = []
    for g in range(4):
        prompt = [rng.randrange(10, VOCAB) for _ in range(4)]
        for k in range(4):
            good = k % 2 == 0
            completion = [PATTERN] * 6 if good else [rng.randrange(10, VOCAB) for _ in range(6)]
            rows.append(row(prompt, completion, advantage=1.0 if good else -1.0, sequence_id=4 * g + k))

    def mean_logprob(good: bool) -> float:
        values = [
            lp
            for r, lps in zip(rows, backend.token_logprobs(rows), strict=True)
            if (r.advantage > 0) == good
            for lp, m in zip(lps, r.loss_mask, strict=True)
            if m
        ]
        return sum(values) / len(values)

    before_good, before_bad = mean_logprob(True), mean_logprob(False)
    for _ in range(4):
        set_behaviour(backend, rows)  # each step on-policy, as in the loop
        backend.train_step(rows, LossConfig(kind="cispo"), micro_batch_tokens=64)
    after_good, after_bad = mean_logprob(True), mean_logprob(False)
    # Measured: −5.4 → −1.2 for the pattern, −6.7 → −8.6 for the rest.
    assert after_good - before_good > 2.0, (before_good, after_good)
    assert before_bad - after_bad > 0.5, (before_bad, after_bad)


@pytest.mark.parametrize(
    "config",
    [
        LossConfig(kind="grpo"),
        LossConfig(kind="cispo"),
        LossConfig(kind="gspo"),
        LossConfig(kind="grpo", aggregation="sequence"),
        LossConfig(kind="gspo", aggregation="sequence"),
        LossConfig(kind="cispo", aggregation="constant", norm_tokens=8),
    ],
    ids=lambda c: f"{c.kind}-{c.aggregation}",
)
def test_micro_batching_does_not_change_the_step(tiny: str, config: LossConfig) -> None:
    """Normalisers over the whole step, whatever the aggregation: one big batch and many small ones
    give the same loss and the same accumulated gradient."""
    rows = mixed_rows(seed=3)
    results = []
    for budget in (1000, 20):
        backend = make(tiny, lr=1e-2, grad_clip=0.0)
        set_behaviour(backend, rows)
        for r in rows:  # off-policy, so ratios and clipping are not all trivial
            r.behaviour_logprobs = [lp - 0.3 * m for lp, m in zip(r.behaviour_logprobs, r.loss_mask, strict=True)]
        grads: dict[str, torch.Tensor] = {}
        for name, p in backend.model.named_parameters():
            if p.requires_grad:  # the last call sees the gradient accumulated over all micro-batches
                p.register_post_accumulate_grad_hook(
                    lambda p, name=name, grads=grads: grads.__setitem__(name, p.grad.clone())
                )
        metrics = backend.train_step(rows, config, micro_batch_tokens=budget)
        results.append((metrics, grads))
    (big, big_grads), (small, small_grads) = results
    assert small["micro_batches"] > 1 == big["micro_batches"]
    assert big["log_ratio_abs_mean"] == pytest.approx(0.3, rel=1e-4)  # the shift above
    for key in ("loss", "grad_norm", "ratio_mean", "log_ratio_abs_mean", "clip_frac", "approx_kl", "tokens"):
        assert small[key] == pytest.approx(big[key], rel=1e-5, abs=1e-7), key
    assert big_grads.keys() == small_grads.keys() and big_grads
    for name, grad in big_grads.items():
        torch.testing.assert_close(small_grads[name], grad, rtol=1e-4, atol=1e-7)


class BigramPolicy:
    """A policy that is no TrainerBackend (one table of next-token logits): ``trainer.step`` needs
    only ``trainer.step.Policy``."""

    def __init__(self, vocab: int = 16, learning_rate: float = 0.05, grad_clip: float = 0.2) -> None:
        torch.manual_seed(0)
        self.model = nn.Module()
        self.model.table = nn.Parameter(torch.randn(vocab, vocab, dtype=torch.float64))
        self.device = torch.device("cpu")
        self.trainable = [self.model.table]
        self.optimizer = make_optimizer(self.trainable, learning_rate, weight_decay=0.01)
        self.learning_rate, self.grad_clip, self.step = learning_rate, grad_clip, 0

    def logprobs(self, batch: dict[str, torch.Tensor], *, trained_only: bool) -> torch.Tensor:
        ids = batch["input_ids"]
        lp = torch.log_softmax(self.model.table[ids[:, :-1]], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return torch.nn.functional.pad(lp, (1, 0))


def test_the_step_is_the_algorithm_for_any_policy() -> None:
    """trainer.step on micro-batches = the whole batch's loss, backward, clip, AdamW, done by hand."""
    rng = random.Random(5)
    rows = [
        row([rng.randrange(16) for _ in range(rng.randint(1, 4))], [rng.randrange(16) for _ in range(rng.randint(1, 6))],
            advantage=rng.choice([-1.0, 1.0]), sequence_id=i)
        for i in range(7)
    ]  # fmt: skip
    rows.append(row([1, 2], [3], 1.0, 7))
    rows[-1].loss_mask = [0, 0, 0]  # context only: skipped, and not counted as a sequence
    config = LossConfig(kind="cispo", aggregation="sequence")
    policy, by_hand = BigramPolicy(), BigramPolicy()
    for r, lps in zip(rows, by_hand.logprobs(collate(rows), trained_only=False).tolist(), strict=True):
        r.behaviour_logprobs = [lp - 0.1 if m else 0.0 for lp, m in zip(lps[: len(r)], r.loss_mask, strict=True)]

    metrics = train_step(policy, rows, config, micro_batch_tokens=12)

    trained = rows[:-1]
    batch = collate(trained)
    out = policy_loss(
        by_hand.logprobs(batch, trained_only=True), batch["behaviour_logprobs"], batch["advantages"],
        batch["loss_mask"], StepTotals(tokens=sum(r.trainable_tokens for r in trained), sequences=7), config,
    )  # fmt: skip
    out.loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(by_hand.trainable, 0.2)
    by_hand.optimizer.step()
    assert metrics["micro_batches"] > 1 and policy.step == 1
    assert metrics["loss"] == pytest.approx(out.loss.item(), rel=1e-6)  # the step sums in float32
    assert metrics["grad_norm"] == pytest.approx(grad_norm.item(), rel=1e-9) and metrics["grad_norm"] > 0.2  # clipped
    assert metrics["log_ratio_abs_mean"] == pytest.approx(0.1, rel=1e-6)  # behaviour logprobs are float32
    torch.testing.assert_close(policy.model.table, by_hand.model.table, rtol=1e-12, atol=1e-12)
    assert policy.model.table.grad is None  # cleared for the next step


def test_gradient_checkpointing_changes_memory_not_results(tiny: str) -> None:
    rows = mixed_rows(seed=7)
    results = []
    for checkpointing in (False, True):
        backend = make(tiny, gradient_checkpointing=checkpointing)
        set_behaviour(backend, rows)
        calls = count_forward_calls(backend.model.get_base_model().get_submodule("model.layers.0.mlp.act_fn"))
        metrics = backend.train_step(rows, LossConfig(kind="grpo"), micro_batch_tokens=40)
        # With checkpointing the backward pass runs each layer's forward a second time.
        assert calls[0] == (2 if checkpointing else 1) * metrics["micro_batches"]
        results.append(metrics)
    for key in ("loss", "grad_norm", "ratio_mean"):
        assert results[1][key] == pytest.approx(results[0][key], rel=1e-5), key


def prefixed_rows(prefix_len: int, seed: int = 0, n: int = 6) -> list[Row]:
    """An agent's rows: one long prompt prefix shared by all (system prompt, tool schemas), then each its own."""
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(prefix_len)]
    rows = mixed_rows(seed, n)
    for r in rows:
        r.input_ids = prefix + r.input_ids
        r.loss_mask = [0] * prefix_len + r.loss_mask
        r.behaviour_logprobs = [0.0] * prefix_len + r.behaviour_logprobs
    return rows


def test_prefix_sharing_is_on_by_default_on_the_cpu(tiny: str) -> None:
    assert make(tiny).share_prefix is True
    assert make(tiny, share_prefix=False).share_prefix is False


def test_a_shared_prefix_runs_once_and_changes_nothing(tiny: str) -> None:
    rows = prefixed_rows(40)
    results = []
    for share in (False, True):
        backend = make(tiny, share_prefix=share)
        set_behaviour(backend, rows)
        positions = [0]
        embed = backend.model.get_base_model().get_input_embeddings()
        embed.register_forward_hook(lambda _m, args, _o: positions.__setitem__(0, positions[0] + args[0].numel()))
        metrics = backend.train_step(rows, LossConfig(kind="grpo"), micro_batch_tokens=1000)
        step_positions = positions[0]
        adapter = {n: p.detach().clone() for n, p in backend.model.named_parameters() if p.requires_grad}
        backend.model.eval()
        results.append((metrics, adapter, backend.token_logprobs(rows), step_positions))
    (plain, plain_adapter, plain_lps, plain_positions), (shared, shared_adapter, shared_lps, shared_positions) = results
    padded = len(rows) * max(len(r) for r in rows)
    assert plain_positions == padded  # one micro-batch: every padded position through the decoder
    assert shared_positions == padded - (len(rows) - 1) * 40  # the 40 shared tokens once, not once a row
    for key in ("loss", "grad_norm", "ratio_mean"):
        assert shared[key] == pytest.approx(plain[key], rel=1e-5), key
    for name, weight in plain_adapter.items():
        torch.testing.assert_close(shared_adapter[name], weight, rtol=0, atol=1e-5)
    for got, want in zip(shared_lps, plain_lps, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-5)


def test_rows_that_share_little_or_nothing_run_whole(tiny: str) -> None:
    backend = make(tiny)
    positions = [0]
    embed = backend.model.get_base_model().get_input_embeddings()
    embed.register_forward_hook(lambda _m, args, _o: positions.__setitem__(0, positions[0] + args[0].numel()))
    rows = prefixed_rows(5)  # below the point where a second decoder call pays
    backend.token_logprobs(rows, micro_batch_tokens=1000)
    assert positions[0] == len(rows) * max(len(r) for r in rows)


def test_non_finite_gradient_raises_and_leaves_the_adapter_untouched(tiny: str) -> None:
    backend = make(tiny)
    rows = set_behaviour(backend, mixed_rows(n=2))
    rows[0].behaviour_logprobs[-1] = float("nan")
    before = {n: p.detach().clone() for n, p in backend.model.named_parameters() if p.requires_grad}
    with pytest.raises(FloatingPointError, match="non-finite gradient norm"):
        backend.train_step(rows, LossConfig(kind="cispo"), micro_batch_tokens=64)
    assert backend.step == 0
    for name, p in backend.model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, before[name]) and p.grad is None


def test_a_step_without_trainable_tokens_or_gspo_ids_is_refused(tiny: str) -> None:
    backend = make(tiny)
    empty = row([1, 2], [3], 1.0, 0)
    empty.loss_mask = [0, 0, 0]
    with pytest.raises(ValueError, match="no trainable tokens"):
        backend.train_step([empty], LossConfig(), micro_batch_tokens=64)
    unnumbered = row([1, 2], [3], 1.0, -1)
    with pytest.raises(ValueError, match="sequence_id"):
        backend.train_step([unnumbered], LossConfig(kind="gspo"), micro_batch_tokens=64)


# ------------------------------------------------------------------------------------ logprobs


def test_chunked_logprobs_match_full_logits(tiny: str) -> None:
    backend = make(tiny, lr=5e-2, logprob_chunk=7)  # many chunks, one spanning two rows
    rows = set_behaviour(backend, mixed_rows(seed=4))
    backend.train_step(rows, LossConfig(), micro_batch_tokens=64)  # a non-zero adapter
    backend.model.eval()
    for r, got in zip(rows, backend.token_logprobs(rows), strict=True):
        assert got[0] == 0.0
        torch.testing.assert_close(
            torch.tensor(got), torch.tensor(full_logits_logprobs(backend.model, r)), rtol=0, atol=1e-5
        )


def test_a_bf16_lm_head_is_an_explicit_choice(tiny: str) -> None:
    rows = mixed_rows(seed=6)
    exact = make(tiny).token_logprobs(rows)
    fast = make(tiny, logprob_dtype="bfloat16").token_logprobs(rows)
    diffs = [abs(a - b) for x, y in zip(exact, fast, strict=True) for a, b in zip(x, y, strict=True)]
    assert 0 < max(diffs) < 0.1


def test_padding_does_not_change_a_rows_logprobs(tiny: str) -> None:
    backend = make(tiny)
    short, long = row([3, 4], [5, 6], 1.0, 0), row(list(range(10, 30)), [8, 9], 1.0, 1)
    alone = backend.token_logprobs([short])[0]
    batched = backend.token_logprobs([long, short], micro_batch_tokens=1000)[1]
    torch.testing.assert_close(torch.tensor(batched), torch.tensor(alone), rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------ the adapter


def test_saved_adapter_is_what_vllm_and_peft_load(tiny: str, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    backend = make(tiny, lr=5e-2)
    rows = set_behaviour(backend, mixed_rows(seed=5))
    base_logprobs = backend.token_logprobs(rows)
    backend.train_step(rows, LossConfig(), micro_batch_tokens=64)
    trained = backend.token_logprobs(rows)
    assert (
        max(abs(a - b) for x, y in zip(trained, base_logprobs, strict=True) for a, b in zip(x, y, strict=True)) > 1e-3
    )

    backend.save(tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    linear = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert sorted(config["target_modules"]) == linear  # concrete names, not "all-linear"
    assert (config["r"], config["lora_alpha"], config["bias"]) == (16, 32, "none")
    assert (tmp_path / "adapter_model.safetensors").is_file()
    check_vllm_adapter(tmp_path, max_lora_rank=16)
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    assert state["step"] == 1 and state["learning_rate"] == 5e-2
    assert state["lora"] == {"rank": 16, "alpha": 32, "targets": "all-linear", "dropout": 0.0}

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny), str(tmp_path)).eval()
    for r, got in zip(rows, trained, strict=True):
        torch.testing.assert_close(
            torch.tensor(full_logits_logprobs(peft_model, r)), torch.tensor(got), rtol=0, atol=1e-5
        )


def test_explicit_targets_and_rank(tiny: str, tmp_path: Path) -> None:
    backend = make(tiny, lora=LoraSpec(rank=8, alpha=16, targets=["q_proj", "v_proj"]))
    backend.save(tmp_path)
    config = check_vllm_adapter(tmp_path)
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"] and config["r"] == 8
    names = [n for n, p in backend.model.named_parameters() if p.requires_grad]
    assert names and all(".q_proj." in n or ".v_proj." in n for n in names)
    with pytest.raises(ValueError, match="not linear modules"):
        make(tiny, lora=LoraSpec(targets=["qproj"]))


def test_lora_spec_validation() -> None:
    with pytest.raises(ValueError, match="vLLM allows"):
        LoraSpec(rank=4)
    with pytest.raises(ValueError, match="all-linear"):
        LoraSpec(targets="q_proj")
    assert LoraSpec(targets=["q_proj"]) == LoraSpec.from_json(LoraSpec(targets=["q_proj"]).to_json())
    assert hash(LoraSpec(targets=["q_proj"]))


def test_check_vllm_adapter_names_what_vllm_refuses(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": 12,
                "target_modules": "all-linear",
                "use_dora": True,
                "modules_to_save": ["lm_head"],
            }
        )
    )
    with pytest.raises(ValueError) as err:
        check_vllm_adapter(tmp_path)
    for what in ("adapter_model.safetensors", "rank", "concrete module names", "DoRA", "modules_to_save"):
        assert what in str(err.value)


def test_flops_per_token_counts_frozen_linears_four_times_and_lora_six(tiny: str) -> None:
    backend = make(tiny)
    attn, mlp = 4 * HIDDEN * HIDDEN, 3 * HIDDEN * FFN  # kv heads = heads here
    frozen = LAYERS * (attn + mlp) + VOCAB * HIDDEN  # + the (tied) LM head matmul
    r = 16
    lora_attn = 4 * r * (HIDDEN + HIDDEN)
    lora_mlp = 3 * r * (HIDDEN + FFN)
    trainable = LAYERS * (lora_attn + lora_mlp)
    assert trainable == sum(p.numel() for p in backend.model.parameters() if p.requires_grad)
    assert backend.flops_per_token() == 4 * frozen + 6 * trainable


def test_models_with_transformed_logits_are_refused() -> None:
    head = nn.Linear(4, 8, bias=False)
    check_logprob_support(SimpleNamespace(), head)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        check_logprob_support(SimpleNamespace(final_logit_softcapping=30.0), head)
    with pytest.raises(ValueError, match="bias"):
        check_logprob_support(SimpleNamespace(), nn.Linear(4, 8))


# ------------------------------------------------------------------------------------ choosing


def test_unsloth_on_this_cpu_machine_is_a_clear_error(tiny: str) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError) as err:
        make_backend("unsloth", tiny, LoraSpec(), 1e-5)
    message = str(err.value)
    assert "\n" not in message
    assert "CUDA" in message and "pip install 'trajgate[gpu]'" in message
    assert resolve_backend_name("auto") == "hf"
    assert isinstance(make_backend("auto", tiny, LoraSpec(), 1e-5, device="cpu"), HFBackend)


def test_unsloth_errors_name_exactly_what_is_missing(monkeypatch: pytest.MonkeyPatch, tiny: str) -> None:
    import importlib.util

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "unsloth" else real_find_spec(name, *a)
    )
    with pytest.raises(RuntimeError, match=r"needs the unsloth package; .*pip install 'trajgate\[gpu\]'") as err:
        UnslothBackend(tiny, LoraSpec(), 1e-5)
    assert "CUDA" not in str(err.value).split(";")[0]
    assert resolve_backend_name("auto") == "hf"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: real_find_spec("torch"))  # "installed"
    assert resolve_backend_name("auto") == "unsloth"
    assert resolve_backend_name("auto", device="cpu") == "hf"
    with pytest.raises(ValueError, match="unknown backend"):
        resolve_backend_name("jax")  # type: ignore[arg-type]
