"""The objectives against reference formulas written independently, token by token, with loops."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.loss import (
    LossConfig,
    StepTotals,
    aggregate_metrics,
    chunked_token_logprobs,
    input_token_logprobs,
    policy_loss,
)

# Hand-made batch: 2 rows × 4 positions. Position 0 is never a target; row 1's last position is
# unmasked and carries a log-ratio that would matter if the mask leaked.
LP = [[0.0, -1.0, -0.5, -2.0], [0.0, -0.3, -1.2, -0.7]]
#          log r:  +0.5  -0.1  +0.1          -0.5  +0.2  (masked: -0.7)
BLP = [[0.0, -1.5, -0.4, -2.1], [0.0, 0.2, -1.4, 0.0]]
MASK = [[0, 1, 1, 1], [0, 1, 1, 0]]
ADV = [1.5, -0.8]
N = 5  # masked tokens in the step


def _leaf(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).requires_grad_(True)


def _run(cfg: LossConfig, lp=LP, blp=BLP, adv=ADV, mask=MASK, total=N, **kw):
    leaf = _leaf(lp)
    totals = StepTotals(tokens=total, sequences=len(lp)) if total > 0 else total
    out = policy_loss(
        leaf, torch.tensor(blp, dtype=torch.float64), torch.tensor(adv), torch.tensor(mask, dtype=torch.float32), totals, cfg, **kw
    )
    out.loss.backward()
    return out, leaf.grad


def _reference(per_token, lp=LP, blp=BLP, adv=ADV, mask=MASK, total=N):
    """Σ over masked (b, t) of per_token(lp_bt, blp_bt, A_b) / total, by loops; returns (loss, grad)."""
    leaf = _leaf(lp)
    loss = leaf.sum() * 0  # part of the graph even when every term is clipped to a constant
    for b in range(len(lp)):
        for t in range(len(lp[b])):
            if mask[b][t]:
                loss = loss + per_token(leaf[b, t], blp[b][t], adv[b])
    loss = loss / total
    loss.backward()
    return loss.item(), leaf.grad


def _clip(x, lo, hi):
    return min(max(x, lo), hi)


# ------------------------------------------------------------------------------------------ grpo


def _grpo_token(eps_low=0.2, eps_high=0.28):
    def f(lp, blp, a):
        r = torch.exp(lp - blp)
        return -min(r * a, _clip(r, 1 - eps_low, 1 + eps_high) * a)

    return f


def test_grpo_value_and_gradient_match_hand_computation() -> None:
    out, grad = _run(LossConfig(kind="grpo"))
    ref_loss, ref_grad = _reference(_grpo_token())
    assert out.loss.item() == pytest.approx(ref_loss, rel=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)
    # Clipped: row 0 pos 1 (A>0, r=e^0.5 > 1.28) and row 1 pos 1 (A<0, r=e^-0.5 < 0.8): 2 of 5.
    assert out.metrics["clip_frac"].item() == pytest.approx(2 / 5)
    assert grad[0, 1] == 0 and grad[1, 1] == 0  # clipped tokens carry no gradient
    assert grad[1, 3] == 0 and grad[0, 0] == 0  # nor do unmasked ones
    # An unclipped token: d/dlp (−r·A/N) = −r·A/N.
    assert grad[0, 2].item() == pytest.approx(-math.exp(-0.1) * 1.5 / N, rel=1e-6)


def test_grpo_metrics_ratio_and_k3_kl() -> None:
    out, _ = _run(LossConfig(kind="grpo"))
    log_r = [0.5, -0.1, 0.1, -0.5, 0.2]
    r = [math.exp(x) for x in log_r]
    m = out.metrics
    assert m["tokens"].item() == 5
    assert m["ratio_mean"].item() == pytest.approx(sum(r) / 5, rel=1e-6)
    assert m["ratio_max"].item() == pytest.approx(max(r), rel=1e-6)
    assert m["ratio_min"].item() == pytest.approx(min(r), rel=1e-6)
    assert m["approx_kl"].item() == pytest.approx(sum(x - 1 - math.log(x) for x in r) / 5, rel=1e-5)
    assert m["log_ratio_abs_mean"].item() == pytest.approx(sum(abs(x) for x in log_r) / 5, rel=1e-6)
    assert not any(v.requires_grad for v in m.values())


# ----------------------------------------------------------------------------------------- cispo


def _cispo_token(lo=0.0, hi=5.0):
    def f(lp, blp, a):
        w = _clip(math.exp(lp.item() - blp), lo, hi)  # a plain float: no gradient through it
        return -w * a * lp

    return f


def test_cispo_value_and_gradient_match_hand_computation() -> None:
    blp = [row[:] for row in BLP]
    blp[0][3] = -4.0  # log r = 2 → r = 7.39 > 5: the weight is clipped, the gradient stays
    out, grad = _run(LossConfig(kind="cispo"), blp=blp)
    ref_loss, ref_grad = _reference(_cispo_token(), blp=blp)
    assert out.loss.item() == pytest.approx(ref_loss, rel=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)
    assert grad[0, 3].item() == pytest.approx(-5.0 * 1.5 / N, rel=1e-6)  # clipped weight 5, still a gradient
    assert out.metrics["clip_frac"].item() == pytest.approx(1 / 5)


def test_cispo_lower_bound_is_exposed() -> None:
    cfg = LossConfig(kind="cispo", cispo_min_ratio=0.9, cispo_max_ratio=1.2)
    out, grad = _run(cfg)
    _, ref_grad = _reference(_cispo_token(0.9, 1.2))
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)
    # r = e^0.5 (>1.2), e^-0.5 (<0.9), e^0.2 (>1.2) are clipped; e^-0.1, e^0.1 are not.
    assert out.metrics["clip_frac"].item() == pytest.approx(3 / 5)


# ------------------------------------------------------------------------------------------ gspo

# π_old for the tests that give it explicitly (several updates per batch): log(π_θ/π_old) on row 0's
# masked tokens is +0.2, −0.05, +0.05 (mean 0.067, s = 1.069, A > 0); on row 1's −0.15, +0.1 (mean
# −0.025, s = 0.975, A < 0). log(π_old/π_b): row 0 +0.3, −0.05, +0.05 (mean 0.1); row 1 −0.35, +0.1.
OLD = [[0.0, -1.2, -0.45, -2.05], [0.0, -0.15, -1.3, -0.9]]


def _gspo_reference(lp, blp, adv, mask, total, groups, eps_low, eps_high, cap=2.0, old=None):
    """Loops: per sequence s = exp(mean log π_θ/π_old), w = min(exp(mean log π_old/π_b), C),
    ℓ = −w·min(sA, clip(s)A), weighted by its token count (token aggregation)."""
    leaf = _leaf(lp)
    old = leaf.detach() if old is None else torch.tensor(old, dtype=torch.float64)
    loss = leaf.sum() * 0  # part of the graph even when every term is clipped to a constant
    for rows in groups:  # each sequence: list of row indices
        tokens = [(b, t) for b in rows for t in range(len(lp[b])) if mask[b][t]]
        s = torch.exp(sum(leaf[b, t] - old[b, t] for b, t in tokens) / len(tokens))
        w = min(math.exp(sum(old[b, t].item() - blp[b][t] for b, t in tokens) / len(tokens)), cap)
        a = adv[rows[0]]
        seq_loss = -w * min(s * a, _clip(s, 1 - eps_low, 1 + eps_high) * a)
        loss = loss + len(tokens) * seq_loss
    loss = loss / total
    loss.backward()
    return loss.item(), leaf.grad


@pytest.mark.parametrize(("eps", "cap"), [((3e-4, 4e-4), 2.0), ((0.2, 0.28), 1.05)])
def test_gspo_value_and_gradient_match_hand_computation(eps, cap) -> None:
    cfg = LossConfig(kind="gspo", gspo_clip_eps=eps[0], gspo_clip_eps_high=eps[1], gspo_is_cap=cap)
    out, grad = _run(cfg, old_logprobs=torch.tensor(OLD, dtype=torch.float64))
    ref_loss, ref_grad = _gspo_reference(LP, BLP, ADV, MASK, N, [[0], [1]], *eps, cap=cap, old=OLD)
    assert out.loss.item() == pytest.approx(ref_loss, rel=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-8)
    # The paper's eps: both sequences moved past the range the way their advantage points, so both
    # are clipped (no gradient). Wide eps: neither is; row 0's weight e^0.1 is capped at 1.05.
    if eps[0] < 0.01:
        assert out.metrics["clip_frac"].item() == 1.0
        assert torch.count_nonzero(grad) == 0
        assert out.metrics["tis_frac"].item() == 0.0
    else:
        assert out.metrics["clip_frac"].item() == 0.0
        assert out.metrics["tis_frac"].item() == pytest.approx(3 / 5)
        # Loss = |o|·(−w·A·s)/N, and ∂s/∂lp_t = s/|o|: each token of row 0 gets −w·A·s/N.
        s0 = math.exp((0.2 - 0.05 + 0.05) / 3)
        assert grad[0, 1].item() == pytest.approx(-1.05 * 1.5 * s0 / N, rel=1e-6)


def test_gspo_ratio_is_against_the_trainers_own_old_policy() -> None:
    """One update per batch: π_old = sg(π_θ), so s ≡ 1 whatever vLLM recorded; the vLLM gap is
    only a truncated weight. Row 0's gap e^{0.5/3} = 1.18 (bypass GSPO: clipped, A > 0), row 1's
    e^{−0.15} = 0.86 (A < 0: clipped too): both train."""
    out, grad = _run(LossConfig(kind="gspo"))
    ref_loss, ref_grad = _gspo_reference(LP, BLP, ADV, MASK, N, [[0], [1]], 3e-4, 4e-4)
    assert out.loss.item() == pytest.approx(ref_loss, rel=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-8)
    assert out.metrics["clip_frac"].item() == 0.0
    assert grad[0, 1].item() == pytest.approx(-math.exp(0.5 / 3) * 1.5 / N, rel=1e-6)
    assert grad[1, 1].item() == pytest.approx(-math.exp(-0.15) * -0.8 / N, rel=1e-6)


def test_gspo_sequence_ids_share_one_ratio_across_rows() -> None:
    cfg = LossConfig(kind="gspo", gspo_clip_eps=0.2, gspo_clip_eps_high=0.28)
    adv = [0.7, 0.7]  # one sequence, one advantage
    old = torch.tensor(OLD, dtype=torch.float64)
    out, grad = _run(cfg, adv=adv, sequence_ids=torch.tensor([4, 4]), old_logprobs=old)
    ref_loss, ref_grad = _gspo_reference(LP, BLP, adv, MASK, N, [[0, 1]], 0.2, 0.28, old=OLD)
    assert out.loss.item() == pytest.approx(ref_loss, rel=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-8)
    # Per-token [B, T] ids (packed rows) group the same way.
    out2, grad2 = _run(cfg, adv=adv, sequence_ids=torch.full((2, 4), 9), old_logprobs=old)
    torch.testing.assert_close(grad2, ref_grad, rtol=1e-5, atol=1e-8)


def test_gspo_trains_every_sequence_under_realistic_vllm_noise() -> None:
    """vLLM (bf16) and the trainer (fp32) disagree by |Δlogπ| ≈ 0.04 per token on the same weights.
    GSPO's paper clip range (3e-4 / 4e-4) must not turn that noise into zero gradients: its ratio is
    against the trainer's own π_old (1 here), the gap goes into a truncated IS weight."""
    g = torch.Generator().manual_seed(3)
    rows, length = 8, 24
    blp = -torch.rand(rows, length, generator=g, dtype=torch.float64) * 3
    lp = (blp + torch.randn(rows, length, generator=g, dtype=torch.float64) * 0.05).requires_grad_(True)
    mask = torch.ones(rows, length)
    mask[:, :4] = 0  # a prompt
    adv = torch.tensor([1.0, -1.0] * (rows // 2), dtype=torch.float64)
    n = int(mask.sum())
    noise = ((lp - blp).abs() * mask).sum() / n
    assert 0.03 < noise.item() < 0.05  # bench/objectives.py measured 0.039 on real vLLM CPU (SmolLM2, temperature 1)

    out = policy_loss(lp, blp, adv, mask, n, LossConfig(kind="gspo"))
    out.loss.backward()
    assert out.metrics["clip_frac"].item() == 0.0
    for b in range(rows):  # every sequence is trained, whichever way its noise points
        assert torch.count_nonzero(lp.grad[b] * mask[b]) == int(mask[b].sum()), b
    # On-policy GSPO (s = 1, ∂s/∂logπ_t = 1/|o|, |o| tokens) times the sequence's truncated IS weight:
    # every token of sequence i gets −w_i·A_i/N with w_i = min(exp(mean_t(logπ_old − logπ_vllm)), 2).
    with torch.no_grad():
        gap = torch.exp(((lp - blp) * mask).sum(1) / mask.sum(1)).clamp(max=2.0)
        expected = -(gap * adv)[:, None] * mask / n
    torch.testing.assert_close(lp.grad, expected, rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------------------------------- TIS


def test_grpo_tis_weights_by_truncated_ratio_once() -> None:
    cap = 1.3
    out, grad = _run(LossConfig(kind="grpo", tis_cap=cap))

    def token(lp, blp, a):
        w = min(math.exp(lp.item() - blp), cap)
        rho = torch.exp(lp - lp.detach())  # π_θ / π_old with π_old the step's starting weights
        return -w * min(rho * a, _clip(rho, 0.8, 1.28) * a)

    ref_loss, ref_grad = _reference(token)
    assert out.loss.item() == pytest.approx(ref_loss, rel=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)
    # Gradient = −min(r, C)·A/N per token: not r·min(r, C).
    assert grad[0, 1].item() == pytest.approx(-cap * 1.5 / N, rel=1e-6)
    # e^0.5 > 1.3 is truncated; e^0.2 = 1.22 and the rest are not.
    assert out.metrics["tis_frac"].item() == pytest.approx(1 / 5)
    # …which is CISPO with clip(r, 0, C).
    _, cispo_grad = _run(LossConfig(kind="cispo", cispo_max_ratio=cap))
    torch.testing.assert_close(grad, cispo_grad, rtol=1e-6, atol=1e-8)


def test_grpo_tis_with_explicit_old_logprobs() -> None:
    cap = 2.0
    old = [[0.0, -1.2, -0.45, -2.05], [0.0, -0.2, -1.3, -0.9]]
    out, grad = _run(LossConfig(kind="grpo", tis_cap=cap), old_logprobs=torch.tensor(old))

    flat_old = {(b, t): old[b][t] for b in range(2) for t in range(4)}
    leaf = _leaf(LP)
    loss = leaf.sum() * 0  # part of the graph even when every term is clipped to a constant
    for b in range(2):
        for t in range(4):
            if MASK[b][t]:
                w = min(math.exp(flat_old[b, t] - BLP[b][t]), cap)
                rho = torch.exp(leaf[b, t] - flat_old[b, t])
                loss = loss - w * min(rho * ADV[b], _clip(rho, 0.8, 1.28) * ADV[b])
    (loss / N).backward()
    assert out.loss.item() == pytest.approx((loss / N).item(), rel=1e-6)
    torch.testing.assert_close(grad, leaf.grad, rtol=1e-5, atol=1e-7)


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        LossConfig(kind="cispo", tis_cap=2.0)
    with pytest.raises(ValueError):
        LossConfig(kind="ppo")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        LossConfig(cispo_min_ratio=2.0, cispo_max_ratio=1.0)
    with pytest.raises(ValueError):
        _run(LossConfig(kind="grpo"), total=0)
    with pytest.raises(ValueError):
        _run(LossConfig(kind="grpo"), old_logprobs=torch.zeros(2, 4))
    with pytest.raises(ValueError):
        LossConfig(kind="gspo", tis_cap=2.0)  # gspo has its own, sequence-level cap
    with pytest.raises(ValueError):
        LossConfig(kind="gspo", gspo_is_cap=0.0)
    with pytest.raises(ValueError):
        LossConfig(aggregation="constant")  # needs its constant
    with pytest.raises(ValueError):
        LossConfig(norm_tokens=128)  # a constant another aggregation would silently ignore
    with pytest.raises(ValueError):
        LossConfig(aggregation="mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        StepTotals(tokens=5, sequences=0)
    with pytest.raises(ValueError, match="StepTotals"):  # a token count cannot normalise per sequence
        policy_loss(_leaf(LP), torch.tensor(BLP), torch.tensor(ADV), torch.tensor(MASK), N, LossConfig(aggregation="sequence"))


# ---------------------------------------------------------------------------------- aggregation

C = 6  # Dr. GRPO's constant (e.g. the longest completion allowed)


def _published_objective(aggregation: str, seqs: list) -> torch.Tensor:
    """J from the papers' formulas, given each sequence's per-token objective terms."""
    G = len(seqs)
    if aggregation == "token":  # DAPO: (1/Σ_i |o_i|) Σ_i Σ_t
        return sum(sum(ts) for ts in seqs) / sum(len(ts) for ts in seqs)
    if aggregation == "sequence":  # DeepSeekMath GRPO: (1/G) Σ_i (1/|o_i|) Σ_t
        return sum(sum(ts) / len(ts) for ts in seqs) / G
    return sum(sum(ts) for ts in seqs) / (G * C)  # Dr. GRPO: (1/G) Σ_i Σ_t, the sum over a constant


def _objective_terms(kind: str, leaf: torch.Tensor) -> list:
    """Per sequence (= row here), the objective's term of each masked token, by loops, in float64."""
    seqs = []
    for b, a in enumerate(ADV):
        ts = [t for t in range(4) if MASK[b][t]]
        if kind == "grpo":
            rs = [torch.exp(leaf[b, t] - BLP[b][t]) for t in ts]
            seqs.append([min(r * a, _clip(r, 0.8, 1.28) * a) for r in rs])
        elif kind == "cispo":
            seqs.append([_clip(math.exp(leaf[b, t].item() - BLP[b][t]), 0.0, 5.0) * a * leaf[b, t] for t in ts])
        else:  # GSPO's one term per sequence, on each of its tokens
            s = torch.exp(sum(leaf[b, t] - leaf[b, t].detach() for t in ts) / len(ts))
            w = min(math.exp(sum(leaf[b, t].item() - BLP[b][t] for t in ts) / len(ts)), 2.0)
            seqs.append([w * min(s * a, _clip(s, 1 - 3e-4, 1 + 4e-4) * a)] * len(ts))
    return seqs


@pytest.mark.parametrize("aggregation", ["token", "sequence", "constant"])
@pytest.mark.parametrize("kind", ["grpo", "cispo", "gspo"])
def test_each_aggregation_is_the_published_formula(kind: str, aggregation: str) -> None:
    cfg = LossConfig(kind=kind, aggregation=aggregation, norm_tokens=C if aggregation == "constant" else None)
    out, grad = _run(cfg)
    leaf = _leaf(LP)
    reference = -_published_objective(aggregation, _objective_terms(kind, leaf))
    reference.backward()
    # (rel 1e-6: the advantages enter policy_loss as float32, -0.8 is not exact there)
    assert out.loss.item() == pytest.approx(reference.item(), rel=1e-6)
    torch.testing.assert_close(grad, leaf.grad, rtol=1e-6, atol=1e-9)
    if kind == "gspo" and aggregation == "sequence":
        # The paper's J_GSPO = (1/G) Σ_i min(s_i Â_i, clip(s_i) Â_i) (here times w_i, the vLLM gap).
        paper = sum(ts[0] for ts in _objective_terms(kind, _leaf(LP))) / len(ADV)
        assert out.loss.item() == pytest.approx(-paper.item(), rel=1e-6)


def test_aggregations_weigh_sequences_differently() -> None:
    """The same data, three different gradients: row 0 (3 tokens) vs row 1 (2 tokens) per token."""
    _, token = _run(LossConfig(kind="grpo"))
    _, sequence = _run(LossConfig(kind="grpo", aggregation="sequence"))
    _, constant = _run(LossConfig(kind="grpo", aggregation="constant", norm_tokens=C))
    r = math.exp(-0.1)  # row 0, position 2: unclipped, ∂(−r·A)/∂lp = −r·A
    assert token[0, 2].item() == pytest.approx(-r * 1.5 / N)  # 1/Σ|o_i|
    assert sequence[0, 2].item() == pytest.approx(-r * 1.5 / (2 * 3))  # 1/(G·|o_0|)
    assert constant[0, 2].item() == pytest.approx(-r * 1.5 / (2 * C))  # 1/(G·C)


# -------------------------------------------------------------------- micro-batching invariance

CONFIGS = [
    LossConfig(kind="grpo"),
    LossConfig(kind="grpo", tis_cap=1.5),
    LossConfig(kind="cispo", cispo_max_ratio=1.5),
    LossConfig(kind="gspo", gspo_clip_eps=0.05, gspo_clip_eps_high=0.05, gspo_is_cap=1.1),
    LossConfig(kind="grpo", aggregation="sequence"),
    LossConfig(kind="grpo", aggregation="constant", norm_tokens=16),
    LossConfig(kind="cispo", aggregation="sequence"),
    LossConfig(kind="gspo", gspo_clip_eps=0.05, gspo_clip_eps_high=0.05, aggregation="sequence"),
    LossConfig(kind="gspo", gspo_clip_eps=0.05, gspo_clip_eps_high=0.05, aggregation="constant", norm_tokens=16),
]


def _config_id(c: LossConfig) -> str:
    return f"{c.kind}{'-tis' if c.tis_cap else ''}-{c.aggregation}"


def _needs_old(c: LossConfig) -> bool:
    """The configs whose clip acts only against an explicit π_old (several updates per batch)."""
    return c.kind == "gspo" or c.tis_cap is not None


def _random_rows(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 3, 5, 9, 4, 6]
    rows = []
    for n in lengths:
        blp = -torch.rand(n, generator=g, dtype=torch.float64) * 3
        lp = blp + torch.randn(n, generator=g, dtype=torch.float64) * 0.4
        old = lp + torch.randn(n, generator=g, dtype=torch.float64) * 0.3
        mask = (torch.rand(n, generator=g) < 0.7).float()
        mask[0] = 0
        mask[1] = 1
        rows.append((lp, blp.float(), mask, torch.randn((), generator=g).item(), old))
    return rows


def _pad(rows, leafs):
    T = max(len(r[0]) for r in rows)
    B = len(rows)
    lp, old = torch.zeros(B, T, dtype=torch.float64), torch.zeros(B, T, dtype=torch.float64)
    blp, mask = torch.zeros(B, T), torch.zeros(B, T)
    for b, ((_, row_blp, row_mask, _, row_old), leaf) in enumerate(zip(rows, leafs, strict=True)):
        n = len(leaf)
        lp = lp.index_put((torch.full((n,), b), torch.arange(n)), leaf)
        blp[b, :n], mask[b, :n], old[b, :n] = row_blp, row_mask, row_old
    return lp, blp, mask, torch.tensor([r[3] for r in rows]), old


@pytest.mark.parametrize("cfg", CONFIGS, ids=_config_id)
def test_micro_batching_gives_the_same_loss_and_gradient(cfg: LossConfig) -> None:
    rows = _random_rows()
    totals = StepTotals(tokens=int(sum(r[2].sum().item() for r in rows)), sequences=len(rows))

    def loss(lp, blp, mask, adv, old):
        return policy_loss(lp, blp, adv, mask, totals, cfg, old_logprobs=old if _needs_old(cfg) else None)

    full_leafs = [r[0].clone().requires_grad_(True) for r in rows]
    lp, blp, mask, adv, old = _pad(rows, full_leafs)
    full = loss(lp, blp, mask, adv, old)
    full.loss.backward()

    micro_leafs = [r[0].clone().requires_grad_(True) for r in rows]
    micro_loss = 0.0
    metrics = []
    for idx in ([0, 1], [2, 3, 4], [5]):
        sub_rows = [rows[i] for i in idx]
        lp, blp, mask, adv, old = _pad(sub_rows, [micro_leafs[i] for i in idx])
        out = loss(lp, blp, mask, adv, old)
        out.loss.backward()  # gradients accumulate in the leaves, as over micro-steps
        micro_loss += out.loss.item()
        metrics.append(out.metrics)

    assert micro_loss == pytest.approx(full.loss.item(), rel=1e-9, abs=1e-12)
    for a, b in zip(full_leafs, micro_leafs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-12)
    # The micro-batch metrics aggregate to the full batch's.
    agg = aggregate_metrics(metrics)
    for key, value in full.metrics.items():
        assert agg[key] == pytest.approx(value.item(), rel=1e-5), key
    if cfg.kind != "cispo":
        assert agg["clip_frac"] > 0  # the test exercises clipping


# -------------------------------------------------------------------------- on-policy / zero adv


@pytest.mark.parametrize("kind", ["grpo", "cispo", "gspo"])
def test_on_policy_is_the_plain_policy_gradient(kind: str) -> None:
    out, grad = _run(LossConfig(kind=kind), lp=BLP)
    m = out.metrics
    assert m["ratio_mean"].item() == 1.0 and m["ratio_max"].item() == 1.0 and m["ratio_min"].item() == 1.0
    assert m["clip_frac"].item() == 0.0
    assert m["approx_kl"].item() == 0.0
    expected = torch.tensor([[-a * mk / N for mk in row] for a, row in zip(ADV, MASK, strict=True)], dtype=torch.float64)
    torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("cfg", CONFIGS, ids=_config_id)
def test_zero_advantage_gives_zero_gradient(cfg: LossConfig) -> None:
    out, grad = _run(cfg, adv=[0.0, 0.0])
    assert torch.count_nonzero(grad) == 0
    assert out.loss.item() == 0.0


def test_per_token_advantages_broadcast_like_per_row() -> None:
    per_row, g1 = _run(LossConfig(kind="grpo"))
    per_token, g2 = _run(LossConfig(kind="grpo"), adv=[[a] * 4 for a in ADV])
    assert per_row.loss.item() == pytest.approx(per_token.loss.item())
    torch.testing.assert_close(g1, g2)


def test_aggregate_metrics_weights_by_tokens() -> None:
    t = torch.tensor
    agg = aggregate_metrics(
        [
            {"tokens": t(1.0), "ratio_mean": t(2.0), "ratio_max": t(2.0), "ratio_min": t(2.0)},
            {"tokens": t(3.0), "ratio_mean": t(1.0), "ratio_max": t(1.5), "ratio_min": t(0.5)},
            {"tokens": t(0.0), "ratio_mean": t(0.0), "ratio_max": t(float("-inf")), "ratio_min": t(float("inf"))},
        ]
    )
    assert agg == {"tokens": 4.0, "ratio_mean": 1.25, "ratio_max": 2.0, "ratio_min": 0.5}


# ----------------------------------------------------------------------------- chunked logprobs


def _full_logprobs(hidden, weight, targets):
    return torch.log_softmax(hidden @ weight.T, dim=-1).gather(-1, targets[..., None]).squeeze(-1)


@pytest.mark.parametrize("chunk", [1, 3, 4, 64])
def test_chunked_logprobs_match_full_log_softmax(chunk: int) -> None:
    g = torch.Generator().manual_seed(1)
    B, T, H, V = 2, 5, 8, 11
    hidden = torch.randn(B, T, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    targets = torch.randint(0, V, (B, T), generator=g)
    upstream = torch.randn(B, T, generator=g)  # a random cotangent, so every entry's gradient counts

    got = chunked_token_logprobs(hidden, weight, targets, chunk=chunk)
    (got * upstream).sum().backward()
    got_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    want = _full_logprobs(hidden, weight, targets)
    (want * upstream).sum().backward()
    assert got.shape == (B, T) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grads[0], hidden.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grads[1], weight.grad, rtol=1e-5, atol=1e-5)


def test_chunked_logprobs_keep_no_logits_for_backward() -> None:
    B, T, H, V, chunk = 2, 10, 4, 50, 8
    hidden = torch.randn(B, T, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    targets = torch.randint(0, V, (B, T))
    saved: list[tuple[int, ...]] = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_token_logprobs(hidden, weight, targets, chunk=chunk).sum().backward()
    assert not any(shape and shape[-1] == V for shape in saved), saved
    # The unchunked computation would have saved [.., V] logits — the check can fail.
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _full_logprobs(hidden, weight, targets).sum()
    assert any(shape and shape[-1] == V for shape in saved)


def test_chunked_logprobs_bf16_inputs_are_scored_in_float32() -> None:
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(1, 6, 16, generator=g).bfloat16()
    weight = torch.randn(40, 16, generator=g).bfloat16()
    targets = torch.randint(0, 40, (1, 6), generator=g)
    got = chunked_token_logprobs(hidden, weight, targets, chunk=4)
    want = _full_logprobs(hidden.float(), weight.float(), targets)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_input_token_logprobs_are_aligned_to_targets() -> None:
    g = torch.Generator().manual_seed(3)
    B, T, H, V = 2, 6, 8, 13
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    out = input_token_logprobs(hidden, weight, ids, chunk=5)
    assert out.shape == (B, T)
    assert torch.all(out[:, 0] == 0)
    for b in range(B):
        for t in range(1, T):  # token t is scored by the hidden state at t − 1
            expected = torch.log_softmax(hidden[b, t - 1] @ weight.T, dim=-1)[ids[b, t]]
            assert out[b, t].item() == pytest.approx(expected.item(), abs=1e-5)


# ------------------------------------------------------------------------------- the run's config


def test_run_config_keys_reach_the_objective() -> None:
    from pydantic import ValidationError

    from gateway.runs.config import RunConfig
    from trainer.worker.loop import loss_config

    default = loss_config(RunConfig())
    assert (default.kind, default.aggregation, default.norm_tokens) == ("cispo", "token", None)
    assert (default.gspo_clip_eps, default.gspo_clip_eps_high, default.gspo_is_cap) == (3e-4, 4e-4, 2.0)
    gspo = loss_config(RunConfig(loss="gspo", gspo_clip_eps=0.01, gspo_clip_eps_high=0.02, gspo_is_cap=1.5))
    assert (gspo.gspo_clip_eps, gspo.gspo_clip_eps_high, gspo.gspo_is_cap) == (0.01, 0.02, 1.5)
    assert loss_config(RunConfig(loss="grpo", loss_aggregation="sequence")).aggregation == "sequence"
    # Dr. GRPO's constant: max_seq_len unless given.
    assert loss_config(RunConfig(loss_aggregation="constant", max_seq_len=512)).norm_tokens == 512
    assert loss_config(RunConfig(loss_aggregation="constant", loss_norm_tokens=100)).norm_tokens == 100
    for bad in (
        {"loss_aggregation": "mean"},
        {"loss_norm_tokens": 100},  # without the constant aggregation it would be ignored
        {"gspo_is_cap": 0},
        {"gspo_clip_eps": 1.0},
        {"loss": "gspo", "truncated_is_cap": 2.0},
    ):
        with pytest.raises(ValidationError):
            RunConfig.model_validate(bad)


def test_the_step_line_shows_the_log_ratio() -> None:
    from trainer.worker.loop import format_step

    metrics = {
        "reward_mean": 0.5, "reward_std": 0.1, "groups_used": 4, "groups_dropped": 0, "tokens": 100,
        "trainable_tokens": 40, "loss": -0.01, "ratio_mean": 1.001, "ratio_max": 1.2, "log_ratio_abs_mean": 0.0213,
        "clip_frac": 0.0, "grad_norm": 0.5, "step_seconds": 2.0, "tokens_per_s": 50.0,
    }  # fmt: skip
    assert "| |log r| 0.0213 |" in format_step(3, metrics)
