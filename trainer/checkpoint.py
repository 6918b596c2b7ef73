"""Checkpoints on disk: ``root/{run}/{step:05d}/`` — the adapter vLLM loads plus the state to resume.

A step's directory appears atomically: the backend writes into a hidden temp directory beside it,
every file is fsynced, then one ``rename`` publishes it. So a numbered directory is always complete,
and a crash leaves at most a ``.tmp-*`` directory, which readers ignore and ``discard_after`` removes.

The database is the truth about which steps happened (docs/design.md §12: a step is committed in one
transaction after its checkpoint is saved). A checkpoint newer than the last committed step is
the leftover of a crash between the save and the commit; on restart ``discard_after(last committed)``
removes it so the step is trained again, and ``save_checkpoint`` refuses to overwrite a step.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from gateway.runs.names import check_run_name
from trainer.backends.base import TrainerBackend

EXTRA_FILE = "checkpoint.json"
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"


def run_dir(root: Path, run: str) -> Path:
    """``root/NAME``: one directory per run, directly under ``root``. Run names follow the gateway's rule
    (gateway.runs.names, so every run the gateway accepts can be trained); hub-style names keep their '/' as
    ``%2F`` ('%' is never in a run name, so the mapping is one-to-one), and no run can reach outside its own
    directory or into another run's."""
    return root / check_run_name(run).replace("/", "%2F")


def checkpoint_dir(root: Path, run: str, step: int) -> Path:
    """Where step ``step`` of ``run`` lives (zero-padded so a listing sorts by step)."""
    return run_dir(root, run) / f"{step:05d}"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(directory: Path) -> None:
    for dirpath, _dirnames, filenames in os.walk(directory):
        for filename in filenames:
            _fsync_path(Path(dirpath) / filename)
        _fsync_path(Path(dirpath))


def save_checkpoint(backend: TrainerBackend, root: Path, run: str, step: int, extra: dict[str, Any]) -> Path:
    """Save ``backend`` as ``root/{run}/{step:05d}`` atomically; ``extra`` (JSON) rides along.

    Raises ``FileExistsError`` if that step already exists: an uncommitted leftover must be removed
    with ``discard_after`` first, and a committed one must never be overwritten (vLLM may be
    serving it).
    """
    if step < 0:
        raise ValueError("step must be >= 0")
    directory = run_dir(root, run)
    directory.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir(root, run, step)
    if final.exists():
        raise FileExistsError(f"checkpoint {final} already exists")
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{step:05d}-", dir=directory))
    try:
        backend.save(tmp)
        (tmp / EXTRA_FILE).write_text(json.dumps(extra, indent=2, sort_keys=True))
        # mkdtemp makes 0700; vLLM may run as another user and must read the adapter.
        for dirpath, _dirnames, _filenames in os.walk(tmp):
            os.chmod(dirpath, 0o755)
        _fsync_tree(tmp)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_path(directory)  # make the rename itself durable
    return final


def _steps(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = [(int(p.name), p) for p in directory.iterdir() if p.name.isascii() and p.name.isdigit() and p.is_dir()]
    return sorted(found)


def latest_checkpoint(root: Path, run: str) -> tuple[int, Path] | None:
    """The newest complete checkpoint of ``run`` as ``(step, path)``, or None. Temp dirs don't count."""
    steps = _steps(run_dir(root, run))
    return steps[-1] if steps else None


def _remove(path: Path) -> None:
    """Rename out of sight first, so a crash mid-delete never leaves a partial numbered dir."""
    trash = path.with_name(f"{_TRASH_PREFIX}{path.name}-{os.getpid()}")
    os.rename(path, trash)
    shutil.rmtree(trash)


def discard_after(root: Path, run: str, step: int) -> list[int]:
    """Remove ``run``'s checkpoints newer than ``step`` (the last committed one) and any temp or
    half-deleted directories left by a crash; returns the removed steps.

    Call it when the trainer starts, before it trains: it assumes no other process is saving
    checkpoints of this run at the same time.
    """
    directory = run_dir(root, run)
    removed = []
    for found, path in _steps(directory):
        if found > step:
            _remove(path)
            removed.append(found)
    if directory.is_dir():
        for leftover in directory.iterdir():
            if leftover.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
                shutil.rmtree(leftover, ignore_errors=True)
    return removed


def load_checkpoint(backend: TrainerBackend, path: Path) -> dict[str, Any]:
    """Restore ``backend`` from a checkpoint directory; returns the ``extra`` saved with it."""
    backend.load(path)
    extra: dict[str, Any] = json.loads((path / EXTRA_FILE).read_text())
    return extra
