"""Data-parallel training on torch.distributed, launched with ``torchrun`` (gloo on CPU, NCCL on CUDA).

Rank 0 is the trainer of ``trainer.worker.loop``: it alone talks to the database (claims, commits, the run's lease),
saves checkpoints and publishes adapters. The other ranks ("followers", ``follow``) hold an identical replica
of the adapter and its optimizer and do what rank 0 tells them over a command channel:

    setup  build the replica (backend, LoRA shape, learning rate, loss, micro-batch budget)
    sync   take rank 0's adapter, optimizer moments and step count (after a resume or a rollback)
    step   train this rank's share of the step's rows (``shard_rows``) in ``trainer.step.train_step``
    close  drop the replica (rank 0 gave the run up)
    stop   exit

Every command but ``stop`` names its run: a job training several runs (``trajgate train --runs``) keeps one replica
per run on every rank, each run's adapter on the one base model the rank loaded first (``ReplicaSpec.shares_base``),
as rank 0 does. Rank 0 talks for a run through ``for_run``, a handle on the same job that tags its commands.

Within a step (``trainer.step.train_step``) the ranks all-reduce the step's totals first, so every rank
normalises its loss by the whole step's trained tokens and sequences; each rank's gradient is then exactly its
share of the single-process gradient, and one all-reduce (SUM) of the adapter's gradients gives every rank the
whole step's gradient: the update, the clipping and the metrics equal the single-process step's. That is
``DistributedDataParallel``'s contract (replicas start equal, gradients are reduced, every rank steps alike)
done by hand: the backends call the decoder and the LM head directly, not the wrapped module's ``forward``
that DDP's reducer hooks, and with micro-batch accumulation DDP would reduce once per step (``no_sync``)
anyway. It also lets a rank without rows (fewer rows than ranks) take part with a zero gradient.

A step commits only after it finished on every rank: its last collective gathers every rank's metrics after
the optimizer step, and rank 0 saves and commits after that returns. A rank that dies makes the others'
collectives fail (or time out after ``timeout_s``), the step raises on rank 0 before anything was saved or
committed, and torchrun stops the job; the claimed groups return to the pool when their lease expires.

Checkpoints are rank 0's replica, which is the whole state: they load with any world size (rank 0 loads one,
``sync`` hands it to the others, so followers need no access to the checkpoint directory).

With ``fsdp`` the ranks also shard the frozen base weights of the decoder layers (FSDP2, ``HFBackend``'s
``fsdp_mesh``), for a base too large for one device. The LoRA weights stay whole on every rank, so all of the above
holds unchanged; every forward pass becomes a collective, so the ranks agree on a number of passes first.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from trainer.backends import TrainerBackend, make_backend
from trainer.loss import LossConfig
from trainer.samples import Row

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger("trajgate.trainer.distributed")

# The command channel waits while rank 0 waits for ready groups, which may take hours: it must not time out.
# Collectives within a step use the job's own timeout instead.
_IDLE_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class Topology:
    """This process's place in the job, as torchrun describes it (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``)."""

    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Topology | None:
        """The torchrun job this process belongs to, or None when it was started on its own."""
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return None
        return cls(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"])))


def shard_rows(rows: Sequence[Row], world_size: int) -> list[list[Row]]:
    """Split a step's rows across ``world_size`` ranks: every row with a trained token exactly once.

    Rows of one GSPO sequence (one ``sequence_id``) stay on one rank, since its ratio is a mean over all its
    tokens; so the step's sequence count is the sum of the ranks'. Sequences go, longest first, to the rank
    with the fewest tokens so far (ties to the lowest rank): the ranks' compute is balanced, and the split is
    a function of the rows alone. A rank may get nothing when there are fewer sequences than ranks.
    """
    if world_size < 1:
        raise ValueError("world_size must be at least 1")
    sequences: dict[int | tuple[str, int], list[Row]] = {}
    for index, row in enumerate(rows):
        if row.trainable_tokens > 0:
            # An unnumbered row (-1) is a sequence of its own.
            key: int | tuple[str, int] = row.sequence_id if row.sequence_id >= 0 else ("row", index)
            sequences.setdefault(key, []).append(row)
    shards: list[list[Row]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for members in sorted(sequences.values(), key=lambda rs: sum(len(r) for r in rs), reverse=True):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        shards[rank].extend(members)
        load[rank] += sum(len(r) for r in members)
    return shards


@dataclass(frozen=True)
class ReplicaSpec:
    """What a follower needs to build the same replica as rank 0: ``make_backend``'s arguments (its own
    device aside) and the step's settings."""

    backend: str
    backend_args: dict[str, Any]
    loss: LossConfig
    micro_batch_tokens: int
    # The run's adapter goes on the base model of the first replica this rank built (several runs in one job).
    shares_base: bool = False


@dataclass
class Command:
    """One message from rank 0 to a follower (the module docstring lists them)."""

    kind: Literal["setup", "sync", "step", "close", "stop"]
    payload: Any = None
    run: str = ""


def _cpu(value: Any) -> Any:
    """A state dict with every tensor on the CPU, so that it pickles for the gloo object channel."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cpu(v) for v in value]
    return value


@dataclass
class _Health:
    """Whether every collective so far succeeded; one per job, shared by its per-run handles (``for_run``)."""

    ok: bool = True


@dataclass
class DataParallel:
    """One rank's handle on a data-parallel job: the ``trainer.step.Collective`` a step uses, and the command
    channel from rank 0 to the followers.

    Three process groups: ``group`` (NCCL on CUDA, gloo on CPU) for tensors within a step; ``objects`` (gloo)
    for Python objects within a step; both time out after the job's ``timeout_s``. ``control`` (gloo) carries
    commands, and waits without a limit while rank 0 waits for work.
    """

    rank: int
    world_size: int
    device: torch.device
    group: Any
    objects: Any
    control: Any
    mesh: DeviceMesh | None = None
    run: str = ""  # the run this handle's commands are for (``for_run``)
    health: _Health = field(default_factory=_Health)

    @property
    def healthy(self) -> bool:
        return self.health.ok

    def for_run(self, run: str) -> DataParallel:
        """A handle on the same job whose commands are for ``run`` (several runs in one job)."""
        return replace(self, run=run)

    @property
    def fsdp(self) -> bool:
        """Whether the ranks shard the base weights (``mesh``, FSDP2: ``HFBackend``'s ``fsdp_mesh``)."""
        return self.mesh is not None

    @classmethod
    def start(
        cls,
        topology: Topology,
        device: str | None,
        timeout_s: float,
        *,
        fsdp: bool = False,
        init_method: str | None = None,
    ) -> DataParallel:
        """Join the job: each rank takes its own GPU (``cuda:LOCAL_RANK``) when the device is CUDA, else the
        CPU; NCCL between GPUs, gloo otherwise. ``fsdp``: a device mesh over all ranks, to shard the base
        weights on. ``init_method`` defaults to torchrun's environment."""
        on_cuda = (device is None and torch.cuda.is_available()) or (device is not None and device.startswith("cuda"))
        if on_cuda:
            here = torch.device("cuda", topology.local_rank)
            torch.cuda.set_device(here)
        else:
            here = torch.device("cpu")
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(
            "nccl" if on_cuda else "gloo",
            init_method=init_method,
            rank=topology.rank,
            world_size=topology.world_size,
            timeout=timeout,
            device_id=here if on_cuda else None,
        )
        objects = dist.new_group(backend="gloo", timeout=timeout) if on_cuda else dist.group.WORLD
        control = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
        mesh = None
        if fsdp:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(here.type, (topology.world_size,))
        return cls(topology.rank, topology.world_size, here, dist.group.WORLD, objects, control, mesh)

    # -- trainer.step.Collective ------------------------------------------------------------------

    def all_sum(self, values: Sequence[float]) -> list[float]:
        """The sum of each value over all ranks (the step's totals, its metrics' counts)."""
        tensor = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        self._checked(dist.all_reduce, tensor, group=self.group)
        return tensor.tolist()

    def passes(self, micro_batches: int) -> int:
        """Under FSDP the most micro-batches any rank has (every rank runs that many passes), else this
        rank's own."""
        if not self.fsdp:
            return micro_batches
        count = torch.tensor([micro_batches], dtype=torch.int64, device=self.device)
        self._checked(dist.all_reduce, count, op=dist.ReduceOp.MAX, group=self.group)
        return int(count.item())

    def reduce_gradients(self, params: Sequence[nn.Parameter]) -> None:
        """Sum the parameters' gradients over all ranks, in one buffer per dtype. A parameter without a
        gradient (a rank that trained no row) counts as zero."""
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            assert p.grad is not None
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            self._checked(dist.all_reduce, flat, group=self.group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order."""
        out: list[Any] = [None] * self.world_size
        self._checked(dist.all_gather_object, out, value, group=self.objects)
        return out

    def build_backend(self, spec: ReplicaSpec, share_base: TrainerBackend | None = None) -> TrainerBackend:
        """This rank's replica: on its own device, its share of the base weights under FSDP; with ``share_base``,
        an adapter of its own on that replica's base model."""
        if self.fsdp and spec.backend != "hf":
            raise ValueError(f"--fsdp shards the hf backend's model; the {spec.backend!r} backend is not supported")
        options = dict(spec.backend_args)
        if self.fsdp:
            options["fsdp_mesh"] = self.mesh
        if share_base is not None:
            options["share_base"] = share_base
        return make_backend(
            spec.backend,  # type: ignore[arg-type]  # resolved by rank 0: "hf" or "unsloth"
            device=str(self.device),
            **options,
        )

    # -- rank 0 -> followers ----------------------------------------------------------------------

    def setup(self, spec: ReplicaSpec) -> None:
        """Rank 0: have the followers build their replicas (``follow``)."""
        self._send([Command("setup", spec, self.run)] * self.world_size)

    def step(self, rows: Sequence[Row]) -> list[Row]:
        """Rank 0: hand each follower its share of the step's rows; returns rank 0's own share."""
        shards = shard_rows(rows, self.world_size)
        self._send([Command("step", shard, self.run) for shard in shards])
        return shards[0]

    def sync(self, backend: TrainerBackend) -> None:
        """Rank 0: make every follower's replica equal to ``backend`` (after a resume or a rollback)."""
        self._send([Command("sync", None, self.run)] * self.world_size)
        self.share_state(backend)

    def release(self) -> None:
        """Rank 0: the followers drop this run's replica (the run was given up). Skipped once a collective failed,
        as ``stop`` is."""
        if self.healthy and self.rank == 0:
            self._send([Command("close", None, self.run)] * self.world_size)

    def share_state(self, backend: TrainerBackend) -> None:
        """Every rank, after ``sync``: rank 0's adapter weights, optimizer moments and step count to all (a DDP
        replica's start). Only the adapter travels; the frozen base is the same weights everywhere."""
        state = [{"optimizer": _cpu(backend.optimizer.state_dict()), "step": backend.step} if self.rank == 0 else None]
        self._checked(dist.broadcast_object_list, state, src=0, group=self.objects)
        with torch.no_grad():
            for p in backend.trainable:
                self._checked(dist.broadcast, p.data, src=0, group=self.group)
        if self.rank != 0:
            shared = state[0]
            assert shared is not None, "broadcast_object_list leaves rank 0's state on every rank"
            # load_state_dict moves each moment to its parameter's device and dtype.
            backend.optimizer.load_state_dict(shared["optimizer"])
            backend.step = int(shared["step"])

    def stop(self) -> None:
        """Rank 0: tell the followers to exit. Skipped when a collective already failed: a dead rank would not
        answer, and torchrun stops the others once one process exits with an error. Stopping torchrun signals
        every rank, so the followers may be gone already: that is only logged."""
        if self.healthy and self.rank == 0:
            try:
                self._send([Command("stop")] * self.world_size)
            except RuntimeError as exc:
                log.warning("the other ranks did not take the stop (stopped already?): %s", str(exc).splitlines()[0])

    def receive(self) -> Command:
        """A follower: the next command from rank 0 (waits as long as rank 0 does)."""
        out: list[Any] = [None]
        self._checked(dist.scatter_object_list, out, None, src=0, group=self.control)
        command: Command = out[0]
        return command

    def close(self) -> None:
        """Leave the job (rank 0 tells the followers to stop first)."""
        try:
            self.stop()
        finally:
            dist.destroy_process_group()

    # -- internals --------------------------------------------------------------------------------

    def _send(self, commands: list[Command]) -> None:
        if self.rank != 0:
            raise RuntimeError("only rank 0 sends commands")
        out: list[Any] = [None]
        self._checked(dist.scatter_object_list, out, commands, src=0, group=self.control)

    def _checked(self, collective: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a collective; if it fails (a rank died, or timed out) mark the job unhealthy and re-raise."""
        try:
            return collective(*args, **kwargs)
        except BaseException:
            self.health.ok = False
            raise


def follow(data_parallel: DataParallel) -> int:
    """A follower's life: build the replicas rank 0 describes (one per run), keep each equal to rank 0's, train
    each step's share, until rank 0 says stop. Returns the process's exit status."""
    replicas: dict[str, tuple[TrainerBackend, ReplicaSpec]] = {}
    base: TrainerBackend | None = None  # the first replica built: the one whose base model the others share
    try:
        while True:
            command = data_parallel.receive()
            if command.kind == "stop":
                return 0
            if command.kind == "setup":
                spec: ReplicaSpec = command.payload
                if spec.shares_base and base is None:
                    raise RuntimeError(f"rank {data_parallel.rank}: run {command.run!r} shares a base never built")
                old = replicas.pop(command.run, None)
                backend = data_parallel.build_backend(spec, base if spec.shares_base else None)
                if old is not None:
                    old[0].close()
                replicas[command.run] = (backend, spec)
                base = base or backend
                continue
            if command.run not in replicas:
                why = f"rank {data_parallel.rank} got {command.kind!r} for run {command.run!r} before its setup"
                raise RuntimeError(why)
            backend, spec = replicas[command.run]
            if command.kind == "sync":
                data_parallel.share_state(backend)
            elif command.kind == "step":
                backend.train_step(command.payload, spec.loss, spec.micro_batch_tokens, data_parallel=data_parallel)
            elif command.kind == "close":
                replicas.pop(command.run)[0].close()
            else:
                raise RuntimeError(f"rank {data_parallel.rank} got an unknown command {command.kind!r}")
    finally:
        for backend, _ in replicas.values():
            backend.close()
