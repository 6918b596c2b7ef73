"""Experiment trackers for `trajgate train --log-to wandb|trackio|mlflow`: every committed step's metrics, the eval
reward per policy version as the store knows it, and a small table of sample trajectories per step.

Each tracker's package is imported only when asked for; a missing one is one clear error line before any weights
load. A tracker that fails mid-run (a network blip) is logged and skipped: it must never stop training.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy import Engine

from gateway.store.progress import eval_curve, sample_trajectories

log = logging.getLogger("trajgate.trackers")

TRACKERS = ("wandb", "trackio", "mlflow")
PACKAGES = {"wandb": "wandb", "trackio": "trackio", "mlflow": "mlflow-skinny"}
SAMPLES_PER_STEP = 8
SAMPLE_COLUMNS = ["trajectory_id", "group_id", "reward", "calls", "last_answer"]


class TrackerError(RuntimeError):
    """A tracker that cannot be used (package missing, unknown name); the message says what to do."""


@dataclass(frozen=True)
class TrackerTarget:
    """Where a tracker logs: its project (W&B project, trackio project, MLflow experiment) and run name."""

    project: str
    name: str
    config: dict[str, Any]


class Tracker(Protocol):
    def log_step(self, step: int, metrics: dict[str, float]) -> None: ...
    def log_eval(self, point: dict[str, Any]) -> None: ...
    def log_samples(self, step: int, rows: list[list[Any]]) -> None: ...
    def close(self) -> None: ...


def flat_metrics(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The step's numbers as flat `a/b` keys (drop reasons, merge breaks are dicts); None, NaN and text left out."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_metrics(value, f"{name}/"))
        elif isinstance(value, bool) or isinstance(value, (int, float)) and math.isfinite(value):
            out[name] = float(value)
    return out


def _import(module: str, tracker: str) -> Any:
    try:
        return __import__(module)
    except ImportError:
        raise TrackerError(
            f"--log-to {tracker} needs the {PACKAGES[tracker]} package: pip install 'trajgate[{tracker}]'"
        ) from None


class WandbTracker:
    """Weights & Biases; WANDB_MODE=offline logs to ./wandb for a later `wandb sync`."""

    def __init__(self, target: TrackerTarget) -> None:
        self.wandb = _import("wandb", "wandb")
        self.run = self.wandb.init(project=target.project, name=target.name, config=target.config)
        # Train metrics by trainer step, eval metrics by policy version: two x axes in one run.
        self.run.define_metric("train/step")
        self.run.define_metric("train/*", step_metric="train/step")
        self.run.define_metric("eval/policy_version")
        self.run.define_metric("eval/*", step_metric="eval/policy_version")

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log({"train/step": step, **{f"train/{k}": v for k, v in metrics.items()}})

    def log_eval(self, point: dict[str, Any]) -> None:
        self.run.log({f"eval/{k}": v for k, v in point.items()})

    def log_samples(self, step: int, rows: list[list[Any]]) -> None:
        self.run.log({"train/step": step, "train/samples": self.wandb.Table(columns=SAMPLE_COLUMNS, data=rows)})

    def close(self) -> None:
        self.run.finish()


class TrackioTracker:
    """trackio: local-first (TRACKIO_DIR, default under HF_HOME); `trackio show` opens its dashboard."""

    def __init__(self, target: TrackerTarget) -> None:
        self.trackio = _import("trackio", "trackio")
        self.trackio.init(project=target.project, name=target.name, config=target.config)

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        self.trackio.log({f"train/{k}": v for k, v in metrics.items()}, step=step)

    def log_eval(self, point: dict[str, Any]) -> None:
        self.trackio.log({f"eval/{k}": v for k, v in point.items() if k != "policy_version"}, step=point["policy_version"])

    def log_samples(self, step: int, rows: list[list[Any]]) -> None:
        self.trackio.log({"train/samples": self.trackio.Table(columns=SAMPLE_COLUMNS, data=rows)}, step=step)

    def close(self) -> None:
        self.trackio.finish()


class MlflowTracker:
    """MLflow (the skinny client): MLFLOW_TRACKING_URI says where, a server or a file store (file:./mlruns)."""

    def __init__(self, target: TrackerTarget) -> None:
        self.mlflow = _import("mlflow", "mlflow")
        self.mlflow.set_experiment(target.project)
        self.run = self.mlflow.start_run(run_name=target.name)
        self.mlflow.log_params({k: str(v)[:500] for k, v in flat_params(target.config).items()})

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        self.mlflow.log_metrics({_mlflow_key(f"train/{k}"): v for k, v in metrics.items()}, step=step)

    def log_eval(self, point: dict[str, Any]) -> None:
        version = int(point["policy_version"])
        values = {_mlflow_key(f"eval/{k}"): float(v) for k, v in point.items() if k != "policy_version"}
        self.mlflow.log_metrics(values, step=version)

    def log_samples(self, step: int, rows: list[list[Any]]) -> None:
        table = [dict(zip(SAMPLE_COLUMNS, row, strict=True)) for row in rows]
        self.mlflow.log_dict(table, f"samples/step_{step:06d}.json")

    def close(self) -> None:
        self.mlflow.end_run()


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _mlflow_key(name: str) -> str:
    """MLflow names allow letters, digits, `_-. /:`; a drop reason is free text."""
    return "".join(c if c.isalnum() or c in "_-. /:" else "_" for c in name)


_KINDS: dict[str, type] = {"wandb": WandbTracker, "trackio": TrackioTracker, "mlflow": MlflowTracker}


def check_trackers(names: Sequence[str]) -> None:
    """Raise TrackerError for a tracker that is unknown or whose package is missing, opening none: a trainer
    checks this before it waits for a run another trainer holds, so the error comes in a second, not minutes."""
    for name in dict.fromkeys(names):
        if name not in _KINDS:
            raise TrackerError(f"unknown tracker {name!r}: expected one of {', '.join(TRACKERS)}")
        _import(name, name)


def open_trackers(names: Sequence[str], target: TrackerTarget) -> list[Tracker]:
    """The trackers asked for, each started once (a name given twice counts once)."""
    check_trackers(names)
    return [_KINDS[name](target) for name in dict.fromkeys(names)]


class StepReporter:
    """Feeds committed steps to the trackers: the step's metrics, a few of its trajectories, and every eval point
    (policy version, mean reward, CI) that is new or has more trajectories since the last step."""

    def __init__(self, engine: Engine, run: str, trackers: list[Tracker]) -> None:
        self.engine, self.run, self.trackers = engine, run, trackers
        self._eval_seen: dict[int, int] = {}

    def report(self, step: int, metrics: dict[str, Any], trajectory_ids: Sequence[str]) -> None:
        if not self.trackers:
            return
        flat = flat_metrics(metrics)
        rows = [[s[c] for c in SAMPLE_COLUMNS] for s in sample_trajectories(self.engine, list(trajectory_ids[:SAMPLES_PER_STEP]))]
        points = []
        for point in eval_curve(self.engine, self.run):
            if self._eval_seen.get(point["policy_version"]) != point["trajectories"]:
                self._eval_seen[point["policy_version"]] = point["trajectories"]
                points.append(point)
        for tracker in self.trackers:
            self._each(tracker, "log_step", step, flat)
            if rows:
                self._each(tracker, "log_samples", step, rows)
            for point in points:
                self._each(tracker, "log_eval", point)

    def close(self) -> None:
        for tracker in self.trackers:
            self._each(tracker, "close")

    @staticmethod
    def _each(tracker: Tracker, method: str, *args: Any) -> None:
        try:
            getattr(tracker, method)(*args)
        except Exception as exc:  # a tracker's outage must not stop training
            log.warning("tracker %s.%s failed: %s: %s", type(tracker).__name__, method, type(exc).__name__, exc)
