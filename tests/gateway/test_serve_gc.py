"""`trajgate serve` keeps the cyclic garbage collector off the hot path (gateway/cli.py `tune_gc`): what the app
holds once built is frozen out of the collector's sight, no garbage is frozen with it, and young collections are
rarer. Run in a child process: the settings are process-wide."""

from __future__ import annotations

import json
import subprocess
import sys

from gateway.cli import GC_THRESHOLDS

SCRIPT = """
import gc, json, tempfile, weakref
from gateway.cli import tune_gc
from gateway.app import create_app
from gateway.runs.settings import Settings

app = create_app(Settings(database_url="sqlite:///:memory:", spool_dir=tempfile.mkdtemp()))

class Cycle:
    def __init__(self):
        self.me = self

garbage = Cycle()
probe = weakref.ref(garbage)
del garbage
tune_gc()
print(json.dumps({"threshold": gc.get_threshold(), "frozen": gc.get_freeze_count(), "garbage_kept": probe() is not None}))
"""


def test_serve_freezes_the_built_app_and_collects_young_objects_rarely() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert tuple(seen["threshold"]) == GC_THRESHOLDS and GC_THRESHOLDS[0] > 700
    assert seen["frozen"] > 10_000  # the app's objects: modules, SQLAlchemy metadata, routes
    assert seen["garbage_kept"] is False  # collected before the freeze, not frozen for ever
