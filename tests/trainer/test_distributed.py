"""Data-parallel steps (trainer.distributed): how a step's rows are split across ranks, and that the ranks'
step is the single-process step: the same global normalisers, the same summed gradient, the same update.

The equality test runs two real gloo ranks (torch.multiprocessing, a file store) on the tiny random Llama and
compares each rank's gradient, just before the optimizer step, with one process's gradient over all the rows;
once with the model whole on each rank (DDP) and once with its base weights sharded across them (FSDP2).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from tests.support.tiny_models import build_tiny_llama, make, mixed_rows, row, set_behaviour
from trainer.distributed import DataParallel, Topology, shard_rows
from trainer.loss import LossConfig
from trainer.samples import Row
from trainer.step import step_totals

WORLD = 2
# The cases the ranks and the single process both train: (loss, how many rows). One row leaves rank 1 with
# nothing to train (it must still take part, with a zero gradient).
CASES: dict[str, tuple[LossConfig, int]] = {
    "grpo-token": (LossConfig(kind="grpo"), 7),
    "cispo-sequence": (LossConfig(kind="cispo", aggregation="sequence"), 7),
    "gspo-constant": (LossConfig(kind="gspo", aggregation="constant", norm_tokens=32), 7),
    "one-row": (LossConfig(kind="grpo"), 1),
}
# float32 sums in another order (per rank, then across ranks): relative differences of ~1e-7 per element.
GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-7


# -------------------------------------------------------------------------------------- splitting


def lengths_row(prompt: int, completion: int, sequence_id: int) -> Row:
    return row([1] * prompt, [2] * completion, advantage=1.0, sequence_id=sequence_id)


def test_every_row_lands_on_exactly_one_rank_and_the_load_is_balanced() -> None:
    rng = random.Random(0)
    rows = [lengths_row(rng.randint(1, 40), rng.randint(1, 20), i) for i in range(23)]
    shards = shard_rows(rows, 3)
    placed = [id(r) for shard in shards for r in shard]
    assert sorted(placed) == sorted(id(r) for r in rows)
    loads = [sum(len(r) for r in shard) for shard in shards]
    assert max(loads) - min(loads) <= max(len(r) for r in rows)  # greedy, longest first
    assert shard_rows(rows, 3) == shards  # a function of the rows: every launch splits alike


def test_a_sequence_stays_on_one_rank_and_rows_without_trained_tokens_go_nowhere() -> None:
    rows = [lengths_row(5, 3, sequence_id=i // 3) for i in range(9)]  # three sequences of three rows
    rows.append(row([1, 2, 3], [], advantage=0.0, sequence_id=9))  # nothing to train
    shards = shard_rows(rows, 2)
    for shard in shards:
        for sequence in {r.sequence_id for r in shard}:
            assert sum(r.sequence_id == sequence for r in shard) == 3
    assert sum(len(shard) for shard in shards) == 9


def test_more_ranks_than_rows_leaves_some_ranks_empty() -> None:
    rows = [lengths_row(4, 4, 0), lengths_row(9, 4, 1)]
    assert [len(shard) for shard in shard_rows(rows, 4)] == [1, 1, 0, 0]
    with pytest.raises(ValueError, match="world_size"):
        shard_rows(rows, 0)


def test_torchrun_environment_is_read_and_its_absence_means_one_process() -> None:
    assert Topology.from_env({}) is None
    assert Topology.from_env({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == Topology(1, 4, 1)


class OtherRanks:
    """A collective whose other ranks hold fixed counts: what step_totals sums into the global totals."""

    def __init__(self, others: Sequence[float]) -> None:
        self.others = others

    def all_sum(self, values: Sequence[float]) -> list[float]:
        return [v + o for v, o in zip(values, self.others, strict=True)]

    def reduce_gradients(self, params: Sequence[nn.Parameter]) -> None:
        raise AssertionError("not used here")

    def all_gather(self, value: Any) -> list[Any]:
        raise AssertionError("not used here")


def test_the_normalisers_are_the_whole_steps_not_the_ranks() -> None:
    mine = [lengths_row(4, 3, sequence_id=0), lengths_row(4, 2, sequence_id=0), lengths_row(6, 5, sequence_id=1)]
    gspo = LossConfig(kind="gspo")
    assert step_totals(mine, gspo).tokens == 10 and step_totals(mine, gspo).sequences == 2
    totals = step_totals(mine, gspo, OtherRanks([30.0, 4.0]))
    assert (totals.tokens, totals.sequences) == (40, 6)
    assert step_totals(mine, LossConfig(kind="grpo"), OtherRanks([0.0, 0.0])).sequences == 3  # a row each
    # A rank with no rows still learns the step's totals; a step with none anywhere is refused.
    assert step_totals([], gspo, OtherRanks([12.0, 2.0])).tokens == 12
    with pytest.raises(ValueError, match="no trainable tokens"):
        step_totals([], gspo, OtherRanks([0.0, 0.0]))


# -------------------------------------------------------------------------- the step on two ranks


def case_rows(tiny: str, count: int) -> list[Row]:
    """Rows with mixed lengths and advantages, behaviour logprobs from a fresh backend (on-policy)."""
    return set_behaviour(make(tiny), mixed_rows(seed=3, n=count))


MODES = ("ddp", "fsdp")


def train_case(tiny: str, name: str, data_parallel: DataParallel | None, rows: list[Row]) -> dict[str, Any]:
    """One step of a fresh backend (seeded: every rank starts alike); the gradient the optimizer got."""
    config, _ = CASES[name]
    sharded = data_parallel is not None and data_parallel.fsdp
    backend = make(tiny, lr=1e-2, grad_clip=0.0, fsdp_mesh=data_parallel.mesh if sharded else None)
    seen: dict[str, Any] = {}
    step = backend.optimizer.step

    def record_then_step(*args: Any, **kwargs: Any) -> Any:
        seen["grads"] = [p.grad.detach().clone() for p in backend.trainable]
        return step(*args, **kwargs)

    backend.optimizer.step = record_then_step  # type: ignore[method-assign]
    mine = rows if data_parallel is None else shard_rows(rows, WORLD)[data_parallel.rank]
    seen["metrics"] = backend.train_step(mine, config, micro_batch_tokens=24, data_parallel=data_parallel)
    seen["params"] = [p.detach().clone() for p in backend.trainable]
    seen["rows"] = len(mine)
    return seen


def rank_main(rank: int, tiny: str, out: str) -> None:
    """One of the two ranks: train every case on its share, in each mode, and save what it saw."""
    torch.set_num_threads(1)
    topology = Topology(rank, WORLD, rank)
    sharding = DataParallel.start(topology, "cpu", 60.0, fsdp=True, init_method=f"file://{out}/store")
    data_parallel = dataclasses.replace(sharding, mesh=None)  # the same ranks, the model whole on each
    try:
        for mode, ranks in zip(MODES, (data_parallel, sharding), strict=True):
            for name, (_, count) in CASES.items():
                seen = train_case(tiny, name, ranks, case_rows(tiny, count))
                torch.save(seen, f"{out}/{mode}-{name}-{rank}.pt")
        if rank != 0:
            assert data_parallel.receive().kind == "stop"  # what rank 0's close() sends
    finally:
        data_parallel.close()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """Both ranks' results for every case (one spawn of two processes for the whole module)."""
    tiny = str(build_tiny_llama(tmp_path_factory.mktemp("tiny")))
    out = tmp_path_factory.mktemp("ranks")
    mp.spawn(rank_main, args=(tiny, str(out)), nprocs=WORLD, join=True)
    return tiny, out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_take_the_single_process_step(ranks: tuple[str, Path], name: str, mode: str) -> None:
    tiny, out = ranks
    # One thread, as each rank has: with more, float sums inside a matmul run in another order (on a loaded
    # machine a gradient element once differed by 1.02e-7 with 2 threads, past the tolerance).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = train_case(tiny, name, None, case_rows(tiny, CASES[name][1]))
    finally:
        torch.set_num_threads(threads)
    first, second = (torch.load(out / f"{mode}-{name}-{rank}.pt") for rank in range(WORLD))
    assert first["rows"] + second["rows"] == alone["rows"]
    if name == "one-row":
        assert second["rows"] == 0
    for rank in (first, second):
        for got, want in zip(rank["grads"], alone["grads"], strict=True):
            torch.testing.assert_close(got, want, rtol=GRAD_RTOL, atol=GRAD_ATOL)
        # (padded_tokens and micro_batches differ: each rank micro-batches its own rows)
        for key in ("loss", "grad_norm", "tokens", "ratio_mean", "ratio_max", "clip_frac", "approx_kl", "input_tokens"):
            assert rank["metrics"][key] == pytest.approx(alone["metrics"][key], rel=1e-5, abs=1e-7), key
    # Both ranks hold the same replica after the step (the same summed gradient, the same AdamW step).
    for a, b in zip(first["params"], second["params"], strict=True):
        assert torch.equal(a, b)
