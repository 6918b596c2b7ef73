"""The trainer worker, one step at a time: wait for ready groups -> claim them -> build samples -> one optimizer
step -> checkpoint -> commit (groups trained + metrics, in one transaction) -> repeat.

The order is what makes a step all-or-nothing: the checkpoint is written (atomically) before the commit, and on
start-up any checkpoint newer than the last committed step is discarded, so a crash anywhere leaves either the
whole step or nothing, and the groups of an uncommitted step return to the pool when their lease expires.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from gateway.runs.config import RunConfig
from gateway.runs.names import check_run_name
from gateway.runs.settings import Settings
from gateway.store import db
from gateway.store.admission import due_groups
from gateway.store.runs import list_runs
from gateway.store.training import (
    LeaseLost,
    ReadyListener,
    RunSpec,
    acquire_run_lease,
    claim_ready_groups,
    commit_step,
    count_ready_groups,
    current_policy_version,
    drop_groups,
    get_run,
    last_step,
    load_groups,
    release_expired_claims,
    release_run_lease,
    renew_leases,
    renew_run_lease,
    run_lease,
)
from trainer.backends import BackendName, LoraSpec, TrainerBackend, make_backend, resolve_backend_name
from trainer.checkpoint import (
    checkpoint_dir,
    discard_after,
    latest_checkpoint,
    load_checkpoint,
    run_dir,
    save_checkpoint,
)
from trainer.distributed import DataParallel, ReplicaSpec
from trainer.loss import LossConfig
from trainer.samples import CallData, GroupData, SampleBatch, SftSelection, TrajectoryData, build_samples
from trainer.sft_data import Conversation, SftStep, plan_steps, sft_data_rows
from trainer.teacher import Teacher, TeacherStore, teacher_logprobs_for_step
from trainer.worker.publish import Publisher, slots_refusal, vllm_admin
from trainer.worker.trackers import StepReporter, TrackerTarget, check_trackers, open_trackers

log = logging.getLogger("trajgate.trainer")

# The warm start's objective (``--sft-data``): the mean cross-entropy of the step's assistant tokens, whatever the
# run's own loss is.
SFT_DATA_LOSS = LossConfig(kind="sft")


class TrainerError(RuntimeError):
    """Something the user must fix before training can start; the message says what."""


class RunMissing(TrainerError):
    """The run does not exist (yet): a trainer told to wait for it tries again later."""


class RunBusy(TrainerError):
    """Another trainer holds the run's lease: a trainer told to wait for it tries again later."""


class RunLost(TrainerError):
    """Another trainer took the run over (this one stalled past its lease): the run is no longer this trainer's."""


@dataclass
class TrainerOptions:
    run: str
    backend: BackendName = "auto"
    device: str | None = None
    dtype: str | None = None
    seed: int = 0
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    lease_s: float = 600.0
    poll_s: float = 1.0
    max_steps: int | None = None
    base_weights: str | None = None
    # Load each committed step into vLLM (TRAJGATE_UPSTREAM_URL) and publish it; off trains without serving.
    publish: bool = True
    wait_for_run: bool = False
    keep_adapters: int = 2
    # vLLM's adapter slots (--max-loras, TRAJGATE_VLLM_MAX_LORAS) for every run together; None: unknown, unchecked.
    max_loras: int | None = None
    # One trainer per run: the run's lease, renewed every third of it; another trainer takes over once it expires.
    run_lease_s: float = 60.0
    # If another trainer holds the run: wait for it (True) or raise TrainerError saying who holds it (False).
    wait_for_lease: bool = True
    # Experiment trackers to log every step to (trainer.worker.trackers): "wandb", "trackio", "mlflow".
    log_to: list[str] = field(default_factory=list)
    tracker_project: str = "trajgate"
    tracker_name: str | None = None  # default: the run's name


def loss_config(config: RunConfig) -> LossConfig:
    """The objective's settings from the run's; Dr. GRPO's constant defaults to ``max_seq_len``, the
    most trained tokens a row can hold."""
    constant = config.loss_aggregation == "constant"
    return LossConfig(
        kind=config.loss,
        clip_eps=config.clip_eps,
        clip_eps_high=config.clip_eps_high,
        cispo_max_ratio=config.cispo_max_ratio,
        gspo_clip_eps=config.gspo_clip_eps,
        gspo_clip_eps_high=config.gspo_clip_eps_high,
        gspo_is_cap=config.gspo_is_cap,
        tis_cap=config.truncated_is_cap,
        aggregation=config.loss_aggregation,
        norm_tokens=(config.loss_norm_tokens or config.max_seq_len) if constant else None,
        distill_reward_weight=config.distill_reward_weight or 0.0,
    )


def sft_selection(config: RunConfig) -> SftSelection | None:
    """Which trajectories loss ``sft`` trains (RunConfig checked that exactly one rule is set); None for the
    policy objectives."""
    if config.loss != "sft":
        return None
    return SftSelection(min_reward=config.sft_min_reward, best_k=config.sft_best_k)


def make_teacher(config: RunConfig, settings: Settings) -> Teacher | None:
    """Loss ``distill``'s teacher: ``teacher`` served at ``teacher_base_url``, by default the run's own (first) vLLM;
    its key is ``TRAJGATE_TEACHER_API_KEY``, else the gateway's upstream key for the run's own vLLM (never sent to
    another endpoint). None for the other objectives."""
    if config.loss != "distill":
        return None
    assert config.teacher is not None  # RunConfig requires it for distill
    key = settings.teacher_api_key or (settings.upstream_api_key if config.teacher_base_url is None else None)
    return Teacher(
        model=config.teacher,
        base_url=config.teacher_base_url or settings.upstream_urls[0],
        api_key=key.get_secret_value() if key else None,
    )


def to_groups(loaded: list[dict[str, Any]]) -> list[GroupData]:
    """The store's plain dicts as the sample builder's input types."""
    return [
        GroupData(
            group_id=group["group_id"],
            trajectories=[
                TrajectoryData(
                    trajectory_id=traj["trajectory_id"],
                    reward=traj["reward"],
                    calls=[CallData(**call) for call in traj["calls"]],
                )
                for traj in group["trajectories"]
            ],
        )
        for group in loaded
    ]


class LeaseKeeper:
    """Renews the claimed groups' leases in the background while a (possibly long) step runs."""

    def __init__(self, engine: Engine, group_ids: list[str], worker: str, lease_s: float) -> None:
        self._args = (engine, group_ids, worker, lease_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)

    def _run(self) -> None:
        engine, group_ids, worker, lease_s = self._args
        while not self._stop.wait(lease_s / 3):
            try:
                renew_leases(engine, group_ids, worker, lease_s)
            except Exception as exc:  # the commit will find out if the lease was really lost
                log.warning("could not renew leases: %s", exc)

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


class RunLeaseKeeper:
    """Holds the run for this trainer: renews its lease in the background for as long as the trainer lives, so a
    second trainer of the run waits, and takes over only once this one is gone (stopped renewing).

    `lost` is set if another trainer took the run over (this one stalled past the lease); the trainer must stop,
    and commit_step refuses its step anyway.
    """

    def __init__(self, engine: Engine, run: str, holder: str, lease_s: float) -> None:
        self.run, self.holder = run, holder
        self._engine, self._lease_s = engine, lease_s
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="run-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self._lease_s / 3):
            try:
                if not renew_run_lease(self._engine, self.run, self.holder, self._lease_s):
                    log.warning("run %r was taken over by another trainer", self.run)
                    self.lost.set()
                    return
            except Exception as exc:  # the database is away: keep trying until the lease really runs out
                log.warning("could not renew the lease on run %r: %s", self.run, exc)

    def stop(self, release: bool = True) -> None:
        """Stop renewing; `release` gives the run up at once (a clean exit) rather than letting the lease expire."""
        self._stop.set()
        self._thread.join()
        if release and not self.lost.is_set():
            try:
                release_run_lease(self._engine, self.run, self.holder)
            except Exception as exc:  # the lease expires on its own; the next trainer just waits for that
                log.warning("could not release the lease on run %r: %s", self.run, exc)


def _local_time(value: datetime) -> str:
    return value.astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


def format_sft_data_step(step: int, metrics: dict[str, Any]) -> str:
    """The line of a warm-start step (``--sft-data``): no reward, no groups."""
    return (
        f"step {step:>4} | sft data {metrics['sft_data']} epoch {metrics['epoch']} | rows {metrics['rows']}"
        f" | tokens {metrics['tokens']} ({metrics['trainable_tokens']} trained) | loss {metrics['loss']:.4f}"
        f" | token accuracy {metrics['token_accuracy']:.3f} | grad {metrics['grad_norm']:.3f}"
        f" | {metrics['step_seconds']:.1f}s | {metrics['tokens_per_s']:.0f} tok/s"
    )


def format_step(step: int, metrics: dict[str, Any]) -> str:
    """The one line per step a user watches."""
    if "token_accuracy" in metrics:  # loss sft: a cross-entropy, no ratio against vLLM
        objective = f"token accuracy {metrics['token_accuracy']:.3f}"
    else:
        objective = (
            f"ratio {metrics['ratio_mean']:.3f} (max {metrics['ratio_max']:.2f})"
            f" | |log r| {metrics['log_ratio_abs_mean']:.4f} | clip {metrics['clip_frac']:.3f}"
        )
    if "reverse_kl" in metrics:  # loss distill
        objective += f" | reverse KL {metrics['reverse_kl']:.4f} | teacher agrees {metrics['teacher_agreement']:.3f}"
    return (
        f"step {step:>4} | reward {metrics['reward_mean']:.3f} ± {metrics['reward_std']:.3f}"
        f" | groups {metrics['groups_used']} used / {metrics['groups_dropped']} dropped"
        f" | tokens {metrics['tokens']} ({metrics['trainable_tokens']} trained)"
        f" | loss {metrics['loss']:+.4f} | {objective} | grad {metrics['grad_norm']:.3f}"
        f" | {metrics['step_seconds']:.1f}s | {metrics['tokens_per_s']:.0f} tok/s"
    )


class Trainer:
    # What the loop was told to stop on (Runs sets it): a step waiting for an unreachable teacher gives up when it is set.
    stopping: threading.Event | None = None

    def __init__(
        self,
        settings: Settings,
        options: TrainerOptions,
        *,
        engine: Engine | None = None,
        echo: Callable[[str], None] = print,
        data_parallel: DataParallel | None = None,
        share_base: TrainerBackend | None = None,
    ) -> None:
        """``data_parallel``: this is rank 0 of a torchrun job (``trainer.distributed``); the other ranks
        build the same replica, train their share of every step and are kept equal to this one.
        ``share_base``: another run's backend whose base model this run's adapter goes on (``Runs``)."""
        self.settings = settings
        self.data_parallel = data_parallel
        self.share_base = share_base
        self.options = options
        self.engine = engine or db.make_engine(settings.database_url)
        self.echo = echo
        self.checkpoints = Path(settings.checkpoint_dir)
        try:
            check_run_name(options.run)
        except ValueError as exc:
            raise TrainerError(f"{exc}; the gateway no longer accepts such a name, create the run under another") from None
        self.spec: RunSpec = self._run_spec()
        try:
            self.config = RunConfig.model_validate(self.spec.config)
        except ValueError as exc:
            raise TrainerError(f"run {options.run!r} has an invalid config: {exc}") from None
        self.loss = loss_config(self.config)
        self.teacher = make_teacher(self.config, settings)
        # Before the lease and the weights: a tracker whose package is missing fails in a second, not minutes.
        target = TrackerTarget(options.tracker_project, options.tracker_name or options.run, self.config.model_dump(mode="json"))
        self.reporter = StepReporter(self.engine, options.run, open_trackers(options.log_to, target))
        # Seconds spent waiting for ready groups since the last committed step: the step's `wait_seconds`, from which
        # the run's read API gives the trainer's idle share (gateway admission trades it against agents' waiting).
        self.idle_s = 0.0
        self._announced = False  # said that this run waits for ready groups, since its last step
        try:
            self.lease = self._take_run()
        except BaseException:  # a Runs trainer goes on, and tries this run again later
            self.reporter.close()
            raise
        try:
            if data_parallel is not None:
                data_parallel.setup(self._replica_spec())  # the followers load their weights meanwhile
            self.backend: TrainerBackend = self._load_backend()
            try:
                self.step = self._resume()
                if data_parallel is not None:
                    data_parallel.sync(self.backend)
                self.publisher = self._publisher() if options.publish else None
            except BaseException:
                self.backend.close()  # off the shared base model: another run's trainer may go on using it
                raise
        except BaseException:
            self.lease.stop()
            self.reporter.close()
            raise

    def _take_run(self) -> RunLeaseKeeper:
        """Become the run's only trainer, waiting while another one holds it (or refusing, without
        `wait_for_lease`). Taken before anything touches the run's checkpoints."""
        name, lease_s = self.spec.name, self.options.run_lease_s
        holder = f"{self.options.worker_id} ({uuid.uuid4().hex[:6]})"
        announced = None
        while True:
            current = run_lease(self.engine, name)
            if current is None or current.lease_until < datetime.now(UTC):
                current = acquire_run_lease(self.engine, name, holder, lease_s)
                if current.holder == holder:
                    return RunLeaseKeeper(self.engine, name, holder, lease_s)
            if not self.options.wait_for_lease:
                raise RunBusy(
                    f"run {name!r} is being trained by {current.holder} until {_local_time(current.lease_until)} "
                    "(renewed while it runs): stop that trainer first, or start this one without --exit-if-busy "
                    "to wait and take over"
                )
            if current.holder != announced:
                self.echo(
                    f"run {name!r} is being trained by {current.holder} until {_local_time(current.lease_until)}; "
                    "waiting"
                )
                announced = current.holder
            time.sleep(self.options.poll_s)

    def close(self) -> None:
        """Give the run up (the next trainer starts at once), take its adapter off a shared base model, close
        the trackers."""
        self.lease.stop()
        self.backend.close()
        if self.data_parallel is not None:
            self.data_parallel.release()  # the other ranks drop this run's replica too
        self.reporter.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _check_lease(self) -> None:
        """Raise TrainerError if another trainer took the run over (this one stalled past its lease): from then on
        the run's checkpoints and steps are the other trainer's."""
        current = run_lease(self.engine, self.spec.name)
        if self.lease.lost.is_set() or current is None or current.holder != self.lease.holder:
            raise RunLost(
                f"run {self.spec.name!r} was taken over by {current.holder if current else 'another trainer'} "
                f"(this trainer stalled past its {self.options.run_lease_s:g}s lease); stopping at step {self.step}"
            )

    def _run_spec(self) -> RunSpec:
        spec = get_run(self.engine, self.options.run)
        if spec is None and self.options.wait_for_run:
            # Under compose the trainer starts before anyone created the run: wait rather than crash-loop.
            self.echo(f"waiting for run {self.options.run!r} to be created (POST /v1/runs or a first call)")
            while spec is None:
                time.sleep(max(self.options.poll_s, 1.0))
                spec = get_run(self.engine, self.options.run)
        if spec is None:
            raise RunMissing(
                f"run {self.options.run!r} does not exist yet: create it with POST /v1/runs, or send a call with "
                f"model={self.options.run!r} through the gateway"
            )
        return spec

    def _base_weights(self) -> str:
        weights = self.options.base_weights or self.spec.base_weights or self.settings.base_weights
        if not weights:
            raise TrainerError(
                f"no weights to train for run {self.spec.name!r}: set base_weights on the run (POST /v1/runs), "
                "TRAJGATE_BASE_WEIGHTS, or --base-weights to the directory vLLM serves"
            )
        return weights

    def _backend_args(self) -> dict[str, Any]:
        """``make_backend``'s arguments but the backend's name and the device (every rank has its own)."""
        return {
            "base_weights": self._base_weights(),
            "lora": LoraSpec(
                rank=self.config.lora_rank, alpha=self.config.lora_alpha, targets=self.config.lora_targets
            ),
            "learning_rate": self.config.learning_rate,
            "dtype": self.options.dtype,
            "seed": self.options.seed,
            "grad_clip": self.config.max_grad_norm,
        }

    def _load_backend(self) -> TrainerBackend:
        if self.share_base is not None:
            args = self._backend_args()
            if args["base_weights"] != self.share_base.base_weights:
                raise TrainerError(
                    f"run {self.spec.name!r} trains {args['base_weights']} but this trainer's base model is "
                    f"{self.share_base.base_weights}: train it in a trainer of its own"
                )
            try:
                return make_backend(
                    "hf", device=self.options.device, share_base=self.share_base, **args
                )
            except ValueError as exc:
                raise TrainerError(f"run {self.spec.name!r}: {exc}") from None
        if self.data_parallel is not None:
            return self.data_parallel.build_backend(self._replica_spec())
        return make_backend(self.options.backend, device=self.options.device, **self._backend_args())

    def _replica_spec(self) -> ReplicaSpec:
        """What every rank builds: rank 0 resolves ``auto`` so that all ranks run the same backend."""
        assert self.data_parallel is not None
        backend = resolve_backend_name(self.options.backend, str(self.data_parallel.device))
        return ReplicaSpec(
            backend, self._backend_args(), self.loss, self.config.micro_batch_tokens, self.share_base is not None
        )

    def _publisher(self) -> Publisher:
        key = self.settings.upstream_api_key
        return Publisher(
            self.engine,
            vllm_admin(self.settings.upstream_urls, key.get_secret_value() if key else None),
            self.spec.name,
            lambda step: checkpoint_dir(self.checkpoints, self.spec.name, step).resolve(),
            keep=self.options.keep_adapters,
            echo=self.echo,
            alive_s=self.settings.peer_alive_s,
            max_loras=self.options.max_loras,
        )

    def _resume(self) -> int:
        """Continue from the last committed step, dropping any checkpoint the database never committed."""
        committed = last_step(self.engine, self.spec.name)
        discard_after(self.checkpoints, self.spec.name, committed)
        if committed == 0:
            return 0
        latest = latest_checkpoint(self.checkpoints, self.spec.name)
        if latest is None or latest[0] != committed:
            raise TrainerError(
                f"run {self.spec.name!r} has committed step {committed} but its checkpoint is missing under "
                f"{run_dir(self.checkpoints, self.spec.name)}: point TRAJGATE_CHECKPOINT_DIR at the directory the trainer used"
            )
        load_checkpoint(self.backend, latest[1])
        self.echo(f"resumed run {self.spec.name!r} at step {committed} from {latest[1]}")
        return committed

    def poll_ready(self) -> bool:
        """Whether a step can start now (``Runs`` waits, woken by Postgres NOTIFY, while no run's can); raises
        RunLost if the run was taken over. Also retries a pending publication and returns expired claims.

        With gateway admission on, the admitted groups this step is the last to train fresh (gateway/store/
        admission.py `due_groups`) are claimed first; while some still play, wait for them unless enough are ready
        to fill the step, so that a slow group is not overtaken by newer ones and dropped as stale.
        """
        self._check_lease()
        if self.publisher is not None:
            self.publisher.reconcile()
        release_expired_claims(self.engine, self.spec.name)
        ready = count_ready_groups(self.engine, self.spec.name)
        due = due_groups(self.engine, self.spec.name)
        if ready >= self.config.groups_per_step and (due.playing == 0 or due.ready >= self.config.groups_per_step):
            return True
        if not self._announced:
            late = f"; {due.playing} admitted group(s) due this step still playing" if due.playing else ""
            self.echo(
                f"waiting for {self.config.groups_per_step} ready groups of run {self.spec.name!r} ({ready} now{late})"
            )
            self._announced = True
        return False

    def train_one_step(self) -> dict[str, Any] | None:
        """Claim, train and commit one step; None if the claimed groups were all dropped (or lost)."""
        started = time.perf_counter()
        worker = self.options.worker_id
        claimed = claim_ready_groups(
            self.engine, self.spec.name, worker, self.config.groups_per_step, self.options.lease_s
        )
        if not claimed:
            return None
        with LeaseKeeper(self.engine, claimed, worker, self.options.lease_s):
            loaded, batch = self._samples(claimed)
            seen = [t.trajectory_id for group in loaded for t in group.trajectories]
            drop_groups(self.engine, batch.dropped_groups, worker, trajectory_ids=seen)
            if not batch.rows:
                reasons = "; ".join(f"{gid}: {why}" for gid, why in batch.dropped_groups)
                self.echo(f"no step: all {len(claimed)} claimed groups were dropped ({reasons})")
                return None
            step = self.step + 1
            self._score_by_teacher(batch, step)
            metrics = self._optimise(batch, step)
            used = sorted(set(claimed) - {gid for gid, _ in batch.dropped_groups})
            trained = [t.trajectory_id for group in loaded if group.group_id in used for t in group.trajectories]
            metrics["step_seconds"] = time.perf_counter() - started
            metrics["wait_seconds"] = self.idle_s
            if not self._commit(step, metrics, used, trained):
                return None
        samples = [group.trajectories[0].trajectory_id for group in loaded if group.group_id in used and group.trajectories]
        self._committed(step, metrics, format_step(step, metrics), samples)
        return metrics

    def _commit(self, step: int, metrics: dict[str, Any], groups: list[str], trajectories: list[str]) -> bool:
        """Checkpoint the trained step, then commit it with its groups and trajectories; False (and the model rolled
        back) if the run or a group was lost meanwhile."""
        self._check_lease()  # a trainer that lost the run must not write into its checkpoints
        # Holding the run, anything newer than the last committed step is an orphan (of a crash, or of a
        # trainer that stalled and lost the run): it must not block this step's save.
        discard_after(self.checkpoints, self.spec.name, self.step)
        save_checkpoint(self.backend, self.checkpoints, self.spec.name, step, {"metrics": metrics})
        try:
            commit_step(
                self.engine, self.spec.name, step, self.options.worker_id, groups, metrics,
                trajectory_ids=trajectories, lease_holder=self.lease.holder,
            )
        except LeaseLost as exc:
            self._check_lease()  # lost the run: its checkpoints are the new trainer's now, touch nothing
            self._roll_back(f"step {step} not committed: {exc}")
            return False
        return True

    def _committed(self, step: int, metrics: dict[str, Any], line: str, samples: list[str]) -> None:
        """A committed step: say it, log it to the trackers, and have vLLM serve it."""
        committed_at = time.perf_counter()
        self.step = step
        self.idle_s = 0.0
        self._announced = False
        self.echo(line)
        self.reporter.report(step, metrics, samples)
        if self.publisher is not None:
            self.publisher.publish(step, committed_at)

    def train_sft_data(self, plan: Sequence[SftStep], source: str, stop: threading.Event | None = None) -> int:
        """The supervised warm start (``trainer.sft_data``): one committed step per planned batch, each checkpointed,
        committed (with no groups) and published exactly like a step of the run's own objective, so the run's next
        steps continue from it. Stops after the current step once ``stop`` is set; returns the steps done."""
        done = 0
        for planned in plan:
            if stop is not None and stop.is_set():
                break
            self._check_lease()
            if self.publisher is not None:
                self.publisher.reconcile()
            step = self.step + 1
            started = time.perf_counter()
            try:
                trained = self.backend.train_step(planned.rows, SFT_DATA_LOSS, self.config.micro_batch_tokens)
            except Exception:
                self._roll_back(f"step {step} failed while training")
                raise
            metrics: dict[str, Any] = {
                **trained,
                "objective": "sft_data",
                "sft_data": source,
                "epoch": planned.epoch,
                "rows": len(planned.rows),
                "tokens": sum(len(row) for row in planned.rows),
                "trainable_tokens": sum(row.trainable_tokens for row in planned.rows),
                "policy_version": current_policy_version(self.engine, self.spec.name),
                "step_seconds": time.perf_counter() - started,
                "wait_seconds": 0.0,
            }
            if not self._commit(step, metrics, [], []):
                break
            self._committed(step, metrics, format_sft_data_step(step, metrics), [])
            done += 1
        return done

    def _samples(self, claimed: list[str]) -> tuple[list[GroupData], SampleBatch]:
        """The claimed groups as loaded (what the step saw), and their training rows. A group that cannot be read
        or built is dropped with the error as its reason: raising here would kill the worker, and the next one
        would claim the same group once its lease expired, and crash the same way, forever."""
        version = current_policy_version(self.engine, self.spec.name)
        try:
            groups = to_groups(load_groups(self.engine, claimed))
            return groups, self._build(groups, version)
        except Exception:
            log.exception("could not build the step's samples; retrying group by group")
        groups, broken, seen = [], [], []
        for group_id in claimed:
            try:
                (group,) = to_groups(load_groups(self.engine, [group_id]))
                seen.append(group)
                self._build([group], version)
            except Exception as exc:
                broken.append((group_id, f"cannot build samples: {type(exc).__name__}: {exc}"[:500]))
            else:
                groups.append(group)
        batch = self._build(groups, version)
        batch.dropped_groups.extend(broken)
        batch.stats["groups_dropped"] += len(broken)
        reasons = batch.stats.setdefault("drop_reasons", {})
        reasons["cannot build samples"] = reasons.get("cannot build samples", 0) + len(broken)
        return seen, batch

    def _build(self, groups: list[GroupData], version: int) -> SampleBatch:
        return build_samples(
            groups,
            advantage_mode=self.config.advantage,
            # distill: a group whose rewards are all equal still has the teacher's signal on every token
            drop_zero_variance=self.config.drop_zero_variance and self.config.loss != "distill",
            max_seq_len=self.config.max_seq_len,
            current_policy_version=version,
            max_staleness=self.config.max_staleness,
            sft=sft_selection(self.config),
        )

    def _score_by_teacher(self, batch: SampleBatch, step: int) -> None:
        """Loss ``distill``: the teacher's logprobs of every row, stored with the step before it trains (a retried step
        reuses them); waits while the teacher is unreachable and raises rather than train on partial logprobs."""
        if self.teacher is None:
            return
        store = TeacherStore(run_dir(self.checkpoints, self.spec.name) / "teacher")
        scored = teacher_logprobs_for_step(
            self.teacher, store, step, [row.input_ids for row in batch.rows], stop=self.stopping, echo=self.echo
        )
        for row, logprobs in zip(batch.rows, scored, strict=True):
            row.teacher_logprobs = logprobs

    def _optimise(self, batch: SampleBatch, step: int) -> dict[str, Any]:
        from tqdm import tqdm

        with tqdm(total=None, desc=f"step {step}", unit="mb", leave=False, disable=None) as bar:

            def progress(done: int, total: int) -> None:
                bar.total = total
                bar.n = done
                bar.refresh()

            try:
                if self.data_parallel is None:
                    trained = self.backend.train_step(batch.rows, self.loss, self.config.micro_batch_tokens, progress)
                else:
                    trained = self.backend.train_step(
                        self.data_parallel.step(batch.rows),
                        self.loss,
                        self.config.micro_batch_tokens,
                        progress,
                        data_parallel=self.data_parallel,
                    )
            except Exception:
                # Data-parallel, every rank failed alike (or one died, and torchrun stops the job): the other
                # ranks are not told to roll back, the step is simply never committed.
                self._roll_back(f"step {step} failed while training", followers=False)
                raise
        # The sample stats count tokens of the rows (all / trained); the backend's own counts are per micro-batch.
        return {**trained, **batch.stats, "policy_version": current_policy_version(self.engine, self.spec.name)}

    def _roll_back(self, why: str, followers: bool = True) -> None:
        """Put the model back to the last committed step: the in-memory update was never committed.
        Data-parallel, the other ranks take this rank's restored replica unless ``followers`` is off."""
        self.echo(f"{why}; rolling back to step {self.step}")
        discard_after(self.checkpoints, self.spec.name, self.step)
        if self.step == 0:
            untrained = self._load_backend()  # a fresh adapter (on the shared base model, beside the old one)
            self.backend.close()
            self.backend = untrained
        else:
            latest = latest_checkpoint(self.checkpoints, self.spec.name)
            assert latest is not None and latest[0] == self.step
            load_checkpoint(self.backend, latest[1])
        if followers and self.data_parallel is not None:
            self.data_parallel.sync(self.backend)

    def finish_publishing(self, stop: threading.Event, timeout_s: float) -> bool:
        """Wait (retrying with backoff) until the last committed step is served; False if it still is not after
        `timeout_s` or `stop`. A worker told to do N steps exits after the last one, and nothing else would retry
        a publication that failed then (vLLM restarting, say)."""
        if self.publisher is None:
            return True
        deadline = time.monotonic() + timeout_s
        while (step := self.publisher.pending()) is not None:
            if stop.is_set() or time.monotonic() >= deadline:
                self.echo(
                    f"step {step} is committed but vLLM does not serve it yet; the next `trajgate train --run "
                    f"{self.spec.name}` publishes it before it trains"
                )
                return False
            self.publisher.reconcile()
            stop.wait(0.5)
        return True

    def run(self, stop: threading.Event | None = None) -> int:
        """Train this run until `stop` is set or `max_steps` steps are done; returns the steps done. The loop is
        ``Runs``'s with this one run in it."""
        return Runs(
            self.settings, self.options, [self.spec.name], engine=self.engine, echo=self.echo, attached=[self]
        ).run(stop)


def warm_start(
    trainer: Trainer,
    conversations: Sequence[Conversation],
    source: str,
    *,
    batch_rows: int,
    epochs: int | None,
    steps: int | None,
    stop: threading.Event | None = None,
) -> int:
    """``trajgate train --sft-data``: render the checked conversations with the base model's own chat template (its
    tokenizer, as vLLM applies it), plan the steps, and train them (``Trainer.train_sft_data``). Every conversation
    is rendered before the first step, so a template that fails on one stops the warm start before it trains."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(trainer.backend.base_weights)
    data = sft_data_rows(tokenizer, conversations, trainer.config.max_seq_len)
    plan = plan_steps(data.rows, batch_rows, epochs, steps, trainer.options.seed)
    cut = f", {data.truncated} row(s) cut at max_seq_len {trainer.config.max_seq_len}" if data.truncated else ""
    dropped = f", {len(data.dropped)} conversation(s) dropped ({'; '.join(data.dropped[:3])})" if data.dropped else ""
    trainer.echo(
        f"sft data {source}: {data.conversations} conversations -> {len(data.rows)} rows, {data.trained_tokens} "
        f"assistant tokens{cut}{dropped}; {len(plan)} step(s) of {batch_rows} rows, from step {trainer.step + 1}"
    )
    return trainer.train_sft_data(plan, source, stop)


class Runs:
    """One trainer process training several runs (docs/training.md, "Several runs in one trainer"); one run is
    the case of a list of one, so there is one loop.

    The first run attached loads the base weights; every other run's backend puts its own adapter on that model
    (``share_base``), so the base is in memory once. Each run keeps its own ``Trainer``: adapter, optimizer,
    lease, checkpoints, step counter, objective settings and publisher.

    The fair rule: among the runs whose next step is ready (``groups_per_step`` ready groups), the one whose last
    turn is oldest goes next; a run that never had a turn goes first, in the order the runs were attached. A turn
    counts whether or not its step commits. So a run with data waits for at most one step of each other run, and
    a run without data is passed over, never waited on.

    ``runs``: the names to train, or None for every run in the database, new ones included as they appear
    (``--all-runs``). A run that is missing (with ``wait_for_run``) or held by another trainer (with
    ``wait_for_lease``) is retried every round while the others train; one taken over by another trainer is
    dropped and the others go on (with ``--all-runs`` it is taken back once it is free). ``max_steps`` is per run.

    ``data_parallel``: this is rank 0 of a torchrun job; each run's trainer talks to the other ranks through its own
    handle (``DataParallel.for_run``), and they keep a replica per run on their one base model, as this rank does.
    """

    def __init__(
        self,
        settings: Settings,
        options: TrainerOptions,
        runs: Sequence[str] | None,
        *,
        engine: Engine | None = None,
        echo: Callable[[str], None] = print,
        attached: Sequence[Trainer] = (),
        data_parallel: DataParallel | None = None,
    ) -> None:
        self.settings, self.options, self.echo = settings, options, echo
        self.data_parallel = data_parallel
        check_trackers(options.log_to)  # now, not once another trainer lets a run go
        self.engine = engine or db.make_engine(settings.database_url)
        self.wanted = None if runs is None else list(dict.fromkeys(runs))
        if self.wanted is not None and not self.wanted:
            raise TrainerError("no run to train: name at least one")
        self.many = self.wanted is None or len(self.wanted) > 1
        if self.many and options.backend == "unsloth":
            raise TrainerError("several runs in one trainer share one base model with the hf backend: use --backend hf")
        if options.keep_adapters < 1:
            raise TrainerError(f"--keep-adapters {options.keep_adapters}: keep at least the newest adapter loaded")
        if self.wanted is not None:
            self._check_slots(self.wanted, raise_=True)
        self.trainers: dict[str, Trainer] = {t.spec.name: t for t in attached}
        self._base: TrainerBackend | None = attached[0].backend if attached else None
        self.done: dict[str, int] = {}
        self._turns: dict[str, int] = {}
        self._turn = 0
        self._names: list[str] = []  # the runs of the last round
        self._said: dict[str, str] = {}  # what the trainer last said about a run it cannot train yet
        self._skipped: set[str] = set()  # with --all-runs: runs this trainer cannot train, and said why

    def steps(self) -> dict[str, int]:
        """Each run's last committed step."""
        return {name: trainer.step for name, trainer in self.trainers.items()}

    def _finished(self, name: str) -> bool:
        return self.options.max_steps is not None and self.done.get(name, 0) >= self.options.max_steps

    def _say_once(self, name: str, line: str) -> None:
        if self._said.get(name) != line:
            self.echo(line)
            self._said[name] = line

    def _attach(self) -> None:
        """Start training the runs not trained yet that can be: they exist, and no other trainer holds them."""
        self._names = self.wanted if self.wanted is not None else [run["name"] for run in list_runs(self.engine)]
        for name in self._names:
            if name in self.trainers or name in self._skipped or self._finished(name):
                continue
            current = run_lease(self.engine, name)
            if current is not None and current.lease_until >= datetime.now(UTC):
                # Checked before building a trainer, which opens the run's trackers.
                busy = RunBusy(
                    f"run {name!r} is being trained by {current.holder} until {_local_time(current.lease_until)} "
                    "(renewed while it runs): stop that trainer first, or start this one without --exit-if-busy "
                    "to wait and take over"
                )
                if not self.options.wait_for_lease and self.wanted is not None:
                    raise busy
                self._say_once(name, f"run {name!r} is being trained by {current.holder} until "
                               f"{_local_time(current.lease_until)}; waiting")
                continue
            if self.wanted is None and not self._check_slots([*self.trainers, name]):
                continue  # --all-runs: a run that would overcommit vLLM's slots waits until there is room
            try:
                self._start(name)
            except RunMissing:
                if not self.options.wait_for_run:
                    raise
                self._say_once(name, f"waiting for run {name!r} to be created (POST /v1/runs or a first call)")
            except RunBusy:  # taken between the look and the try: next round
                continue
            except TrainerError as exc:
                if self.wanted is not None:
                    raise
                self.echo(f"{exc}; not training it")
                self._skipped.add(name)

    def _check_slots(self, runs: list[str], raise_: bool = False) -> bool:
        """Whether vLLM has adapter slots for `runs` beside what the other runs hold (docs/training.md, "Several runs
        in one trainer"); with `raise_`, refuse with the numbers rather than answer False. Unchecked when publishing
        is off or TRAJGATE_VLLM_MAX_LORAS is unknown."""
        if not self.options.publish or self.options.max_loras is None:
            return True
        refusal = slots_refusal(self.engine, runs, self.options.keep_adapters, self.options.max_loras)
        if refusal is not None and raise_:
            raise TrainerError(refusal)
        if refusal is not None:
            self._say_once(runs[-1], f"run {runs[-1]!r} not attached, retried while the others train: {refusal}")
        return refusal is None

    def _start(self, name: str) -> None:
        options = replace(
            self.options,
            run=name,
            wait_for_run=False,
            wait_for_lease=False,
            # One base model for all: the hf backend, whose adapters can share it.
            backend="hf" if self.many else self.options.backend,
            # Several runs: a tracker run each, named after it (TRAJGATE_TRACKER_NAME-RUN when one is given).
            tracker_name=f"{self.options.tracker_name}-{name}" if self.many and self.options.tracker_name
            else self.options.tracker_name,
        )
        echo = self.echo if not self.many else (lambda line: self.echo(f"[{name}] {line}"))
        trainer = Trainer(
            self.settings, options, engine=self.engine, echo=echo, share_base=self._base,
            data_parallel=self.data_parallel.for_run(name) if self.data_parallel is not None else None,
        )  # fmt: skip
        self.trainers[name] = trainer
        self._said.pop(name, None)
        if self._base is None:
            self._base = trainer.backend

    def _drop(self, trainer: Trainer, lost: RunLost) -> None:
        """A run another trainer took over: the others go on (alone, the trainer stops with the error)."""
        if not self.many:
            raise lost
        name = trainer.spec.name
        self.echo(f"{lost}; training the other runs on")
        del self.trainers[name]
        trainer.close()
        if self.wanted is not None:
            self.wanted.remove(name)

    def _ready(self, trainer: Trainer) -> bool:
        try:
            return trainer.poll_ready()
        except RunLost as lost:
            self._drop(trainer, lost)
            return False

    def _all_finished(self) -> bool:
        if self.wanted is not None:
            return all(self._finished(name) for name in self.wanted)
        names = [name for name in self._names if name not in self._skipped]
        return self.options.max_steps is not None and bool(names) and all(self._finished(n) for n in names)

    def run(self, stop: threading.Event | None = None) -> int:
        """Train until `stop` is set or every run has done `max_steps` steps; returns the steps done, all runs."""
        stop = stop or threading.Event()
        listener = ReadyListener(self.engine, "")  # woken by a group of any run becoming ready
        total = 0
        try:
            while not stop.is_set():
                self._attach()
                if self._all_finished():
                    break
                waiting = time.perf_counter()
                ready = [t for t in list(self.trainers.values()) if not self._finished(t.spec.name) and self._ready(t)]
                if not ready:
                    listener.wait(self.options.poll_s, stop)
                    for trainer in self.trainers.values():
                        trainer.idle_s += time.perf_counter() - waiting
                    continue
                trainer = min(ready, key=lambda t: self._turns.get(t.spec.name, -1))  # first of equals: attach order
                name = trainer.spec.name
                self._turns[name] = self._turn
                self._turn += 1
                trainer.stopping = stop  # a distill step waiting for its teacher ends when the trainer stops
                try:
                    trained = trainer.train_one_step()
                except RunLost as lost:
                    self._drop(trainer, lost)
                    continue
                except InterruptedError:  # stopped while the step waited for its teacher: nothing was trained
                    break
                if trained is not None:
                    self.done[name] = self.done.get(name, 0) + 1
                    total += 1
        finally:
            listener.close()
        return total

    def finish_publishing(self, stop: threading.Event, timeout_s: float) -> bool:
        """``Trainer.finish_publishing`` for every run, within one `timeout_s` in all."""
        deadline = time.monotonic() + timeout_s
        served = [t.finish_publishing(stop, max(0.0, deadline - time.monotonic())) for t in self.trainers.values()]
        return all(served)

    def close(self) -> None:
        """Give every run up (``Trainer.close``)."""
        while self.trainers:
            self.trainers.popitem()[1].close()
