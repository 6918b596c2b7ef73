"""bench/writer_starved.py runs and prints one row per writer setting (a short run on an idle machine)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(sys.platform != "linux", reason="the benchmark lowers a thread's own priority: Linux only")
def test_writer_starved_prints_a_row_per_setting() -> None:
    command = [sys.executable, "bench/writer_starved.py", "--busy", "0", "--seconds", "0.3", "--rounds", "2"]
    command += ["--settings", "0", "19+idle"]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    rows = [line for line in run.stdout.splitlines() if re.match(r"\| nice \d", line)]
    assert [row.split("|")[1].strip() for row in rows] == ["nice 0", "nice 19 + SCHED_IDLE"]
    for row in rows:
        cells = [cell.strip() for cell in row.split("|")[2:-1]]
        stored, submitted = (int(n.replace(",", "")) for n in cells[3].split(" of "))
        assert submitted > 0 and 0 <= stored <= submitted
        assert "inf" not in cells[4:]  # every reward's records stored within flush's 30 s


def test_writer_starved_refuses_a_setting_it_cannot_apply() -> None:
    run = subprocess.run(
        [sys.executable, "bench/writer_starved.py", "--settings", "20"], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 2 and "a nice value 0-19" in run.stderr
