"""`trajgate train --log-to`: each tracker, offline (W&B offline mode, trackio's local store, an MLflow file store),
gets every step's metrics, the eval reward per policy version and a table of sample trajectories; a missing
package is one error line. Each tracker runs in its own process: they read their directories from the environment
at import time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.store import db
from tests.support.ui_seed import EVAL_REWARDS, RUN, STEP_METRICS, seed
from trainer.worker.trackers import TrackerError, TrackerTarget, flat_metrics, open_trackers

REPO = Path(__file__).resolve().parents[3]

# Logs the seeded run's two steps through StepReporter as the trainer does, then reads back what the tracker stored.
SCRIPT = r"""
import json, sys
from gateway.store import db
from gateway.store.runs import steps_after
from trainer.worker.trackers import StepReporter, TrackerTarget, open_trackers

kind, url, out = sys.argv[1:4]
engine = db.make_engine(url)
trackers = open_trackers([kind], TrackerTarget("trajgate-test", "ui-run-test", {"lr": 3e-4, "sampling": {"temperature": 1.0}}))
reporter = StepReporter(engine, "ui-run", trackers)
for step in steps_after(engine, "ui-run"):
    reporter.report(step["step"], step["metrics"], ["g0-t0", "g1-t1"])
reporter.close()
read = {}
if kind == "mlflow":
    from mlflow.tracking import MlflowClient
    client = MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name("trajgate-test").experiment_id])
    read["reward_mean"] = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/reward_mean")]
    read["eval"] = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval/mean_reward")]
    read["drop"] = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/drop_reasons/zero reward variance")]
    read["params"] = run.data.params
    read["samples"] = json.loads(open(client.download_artifacts(run.info.run_id, "samples/step_000001.json")).read())
elif kind == "trackio":
    from trackio.sqlite_storage import SQLiteStorage
    logs = SQLiteStorage.get_logs("trajgate-test", "ui-run-test")
    read["reward_mean"] = [(row["step"], row["train/reward_mean"]) for row in logs if "train/reward_mean" in row]
    read["eval"] = [(row["step"], row["eval/mean_reward"]) for row in logs if "eval/mean_reward" in row]
    read["samples"] = [row["train/samples"] for row in logs if "train/samples" in row]
elif kind == "wandb":  # the offline run file: LevelDB-log framed protobuf records (wandb has no reader for it)
    import glob, os, struct, time
    from wandb.proto import wandb_internal_pb2

    def history(path):
        raw, pos, pending, rows = open(path, "rb").read(), 7, b"", []
        while pos + 7 <= len(raw):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            _, length, part = struct.unpack("<IHB", raw[pos:pos + 7])
            pending, pos = pending + raw[pos + 7:pos + 7 + length], pos + 7 + length
            if part in (1, 4):  # a whole record, or its last fragment
                record = wandb_internal_pb2.Record()
                record.ParseFromString(pending)
                pending = b""
                if record.WhichOneof("record_type") == "history":
                    rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
        return rows

    # wandb's own service process writes the file; it may still be at it when the logging process has exited.
    deadline = time.monotonic() + 30
    while True:
        paths = glob.glob("wandb/offline-run-*/run-*.wandb")
        rows = history(paths[0]) if len(paths) == 1 else []
        done = sum("eval/mean_reward" in r for r in rows), sum("train/samples/path" in r for r in rows)
        if done >= tuple(int(n) for n in os.environ["WANDB_EXPECT"].split(",")) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    path = paths[0]
    read["reward_mean"] = [(r["train/step"], r["train/reward_mean"]) for r in rows if "train/reward_mean" in r]
    read["eval"] = [(r["eval/policy_version"], r["eval/mean_reward"]) for r in rows if "eval/mean_reward" in r]
    files = os.path.join(os.path.dirname(path), "files")
    read["samples"] = [json.load(open(os.path.join(files, r["train/samples/path"]))) for r in rows if "train/samples/path" in r]
json.dump(read, open(out, "w"))
"""


@pytest.fixture
def seeded(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'trajgate.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    try:
        seed(engine)
    finally:
        engine.dispose()
    return url


def _log(kind: str, url: str, tmp_path: Path, env: dict[str, str]) -> dict:
    out = tmp_path / f"{kind}.json"
    work = tmp_path / kind
    work.mkdir()
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, kind, url, str(out)],
        cwd=work, env={**os.environ, "PYTHONPATH": str(REPO), **env}, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(out.read_text())


def _expected_eval() -> list[list[float]]:
    return [[v, sum(r) / len(r)] for v, r in sorted(EVAL_REWARDS.items())]


def test_mlflow_file_store(seeded: str, tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    read = _log("mlflow", seeded, tmp_path, {"MLFLOW_TRACKING_URI": f"file:{tmp_path / 'mlruns'}", "MLFLOW_ALLOW_FILE_STORE": "true"})
    assert read["reward_mean"] == [[i + 1, m["reward_mean"]] for i, m in enumerate(STEP_METRICS)]
    assert read["eval"] == _expected_eval()  # x axis: the policy version
    assert read["drop"] == [[1, 1.0], [2, 0.0]] or read["drop"] == [[1, 1.0]]
    assert read["params"]["lr"] == "0.0003" and read["params"]["sampling.temperature"] == "1.0"
    assert [row["trajectory_id"] for row in read["samples"]] == ["g0-t0", "g1-t1"]
    assert read["samples"][0]["reward"] == 1.0 and read["samples"][0]["calls"] == 2
    assert read["samples"][0]["last_answer"] == "Oslo"


def test_trackio_local(seeded: str, tmp_path: Path) -> None:
    pytest.importorskip("trackio")
    read = _log("trackio", seeded, tmp_path, {"TRACKIO_DIR": str(tmp_path / "trackio"), "HF_HUB_OFFLINE": "1"})
    assert read["reward_mean"] == [[i + 1, m["reward_mean"]] for i, m in enumerate(STEP_METRICS)]
    assert read["eval"] == _expected_eval()
    assert len(read["samples"]) == len(STEP_METRICS)
    assert "g0-t0" in json.dumps(read["samples"][0])


def test_wandb_offline(seeded: str, tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    expect = f"{len(EVAL_REWARDS)},{len(STEP_METRICS)}"  # eval points, sample tables: the reader waits for them
    read = _log("wandb", seeded, tmp_path, {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_EXPECT": expect})
    assert read["reward_mean"] == [[i + 1, m["reward_mean"]] for i, m in enumerate(STEP_METRICS)]
    assert read["eval"] == _expected_eval()
    assert len(read["samples"]) == len(STEP_METRICS)
    assert read["samples"][0]["columns"][0] == "trajectory_id" and [r[0] for r in read["samples"][0]["data"]] == ["g0-t0", "g1-t1"]


def test_flat_metrics_keep_numbers_only() -> None:
    flat = flat_metrics({"loss": 0.5, "nan": float("nan"), "none": None, "text": "x", "drop_reasons": {"stale policy": 2},
                         "ok": True})  # fmt: skip
    assert flat == {"loss": 0.5, "drop_reasons/stale policy": 2.0, "ok": 1.0}


def test_missing_package_is_one_line(seeded: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` meets when it is not installed
    with pytest.raises(TrackerError, match=r"^--log-to wandb needs the wandb package: pip install 'trajgate\[wandb\]'$"):
        open_trackers(["wandb"], TrackerTarget("p", "n", {}))
    with pytest.raises(TrackerError, match="unknown tracker"):
        open_trackers(["tensorboard"], TrackerTarget("p", "n", {}))
    # the CLI says it in one line and exits 2, before loading any weights
    shim = tmp_path / "shim" / "wandb"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('No module named wandb')\n")
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "train", "--run", RUN, "--log-to", "wandb", "--base-weights", "/nonexistent"],
        env={**os.environ, "PYTHONPATH": f"{shim.parent}{os.pathsep}{REPO}", "TRAJGATE_DATABASE_URL": seeded},
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "trajgate train: --log-to wandb needs the wandb package: pip install 'trajgate[wandb]'"
    ]
