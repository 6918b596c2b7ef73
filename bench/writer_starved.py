"""The writer on a machine that other processes keep busy: the event loop's stalls and a reward's wait.

Beside a vLLM CPU or a CPU trainer, how late the event loop's thread gets the GIL back, and how long a reward waits
for its trajectory's records.

A lowered writer (TRAJGATE_WRITER_NICE, TRAJGATE_WRITER_IDLE) gets little of a core that other processes keep busy,
and when the kernel preempts it while it holds the GIL, every other thread of the gateway waits until the writer is
scheduled again. This script starts `--busy` processes spinning at normal priority (by default one per CPU this
process may use; `--pin` puts them and this process on CPU 0 alone), then for each writer setting (`--settings`: a
nice value, `+idle` for SCHED_IDLE as well; by default 0, 19 and 19+idle, the gateway's default), with the gateway's
default slices and pauses:
  * loop: this thread submits a record, sleeps 5 ms and records how late it woke with the GIL, for `--seconds`;
    figures: p50/p99/max lateness, and how many of the records the writer stored meanwhile;
  * reward: `--rounds` times, 5 records submitted then `flush` (what a reward waits on, 5 s): p50 and max.

    .venv/bin/python bench/writer_starved.py                 # busy processes on every CPU, ~1 min
    .venv/bin/python bench/writer_starved.py --busy 0        # an idle machine, for comparison
    .venv/bin/python bench/writer_starved.py --pin --busy 1  # one busy process on the gateway's own core
    .venv/bin/python bench/writer_starved.py --settings 0 5 10 19 19+idle

Linux only (a thread's own priority).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere, like the other benchmarks
    sys.path.insert(0, str(REPO))

from gateway.recorder.writer import RecordWriter  # noqa: E402
from gateway.runs.settings import Settings  # noqa: E402
from gateway.store import db  # noqa: E402
from tests.support.factories import make_record  # noqa: E402


def _setting(text: str) -> tuple[int, bool]:
    """`N` or `N+idle`: the writer's nice value, and SCHED_IDLE as well."""
    nice, _, idle = text.partition("+")
    if not nice.isdigit() or int(nice) > 19 or idle not in ("", "idle"):
        raise argparse.ArgumentTypeError(f"{text!r}: a nice value 0-19, optionally followed by +idle")
    return int(nice), idle == "idle"


def _writer(directory: Path, nice: int, idle: bool) -> RecordWriter:
    url = f"sqlite:///{directory}/calls.db"
    db.upgrade(url)
    defaults = Settings()
    writer = RecordWriter(
        db.make_engine(url),
        directory / "spool",
        slice_s=defaults.writer_slice_us / 1e6,
        pause_s=defaults.writer_pause_us / 1e6,
        calls_in_flight=lambda: 1,  # a call in flight, as at c=1: the writer gives way at each slice
        nice=nice,
        idle=idle,
    )
    writer.start()
    return writer


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


def measure(nice: int, idle: bool, seconds: float, rounds: int) -> str:
    """One writer setting's table row."""
    name = f"nice {nice}" + (" + SCHED_IDLE" if idle else "")
    with tempfile.TemporaryDirectory() as tmp:
        writer = _writer(Path(tmp), nice, idle)
        try:
            late: list[float] = []
            written = writer.counters.records_written
            end = time.monotonic() + seconds
            submitted = 0
            while time.monotonic() < end:
                writer.submit(make_record(f"loop-{submitted}", 0))
                submitted += 1
                began = time.monotonic()
                time.sleep(0.005)
                late.append(time.monotonic() - began - 0.005)
            stored = writer.counters.records_written - written
            waits: list[float] = []
            for round_ in range(rounds):
                began = time.monotonic()
                for seq in range(5):
                    writer.submit(make_record(f"reward-{round_}", seq))
                ok = writer.flush(30)
                waits.append(time.monotonic() - began if ok else float("inf"))
            late.sort()
            return (
                f"| {name} | {_ms(late[len(late) // 2])} | {_ms(late[int(len(late) * 0.99)])} | {_ms(late[-1])} | "
                f"{stored:,} of {submitted:,} | {_ms(statistics.median(waits))} | {_ms(max(waits))} |"
            )
        finally:
            writer.close(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--busy", type=int, default=None, help="busy processes (default: one per usable CPU)")
    parser.add_argument("--pin", action="store_true", help="this process and the busy ones on CPU 0 alone")
    parser.add_argument("--seconds", type=float, default=8.0, help="length of the loop phase per setting (8)")
    parser.add_argument("--rounds", type=int, default=10, help="reward rounds per setting (10)")
    parser.add_argument(
        "--settings",
        nargs="+",
        type=_setting,
        default=[(0, False), (19, False), (19, True)],
        help="writer settings: a nice value, +idle for SCHED_IDLE as well (default: 0 19 19+idle)",
    )
    args = parser.parse_args()
    if sys.platform != "linux":
        sys.exit("Linux only: a thread's own priority is set only there")
    if args.pin:
        os.sched_setaffinity(0, {0})
    busy = len(os.sched_getaffinity(0)) if args.busy is None else args.busy
    spin = ["taskset", "-c", "0"] if args.pin else []
    spinners = [subprocess.Popen([*spin, sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        time.sleep(1.0)
        cpus = "CPU 0" if args.pin else f"{len(os.sched_getaffinity(0))} CPUs"
        print(f"{busy} busy processes on {cpus}; loop {args.seconds:.0f} s, {args.rounds} reward rounds per setting")
        print("| writer | loop late p50 ms | p99 ms | max ms | stored meanwhile | reward wait p50 ms | max ms |")
        print("|---|---|---|---|---|---|---|")
        for nice, idle in args.settings:
            print(measure(nice, idle, args.seconds, args.rounds), flush=True)
    finally:
        for spinner in spinners:
            spinner.kill()


if __name__ == "__main__":
    main()
