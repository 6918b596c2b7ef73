"""What the gateway adds to a call, with capture on, against calling the upstream directly and against a thin proxy
that records nothing: one run, one table.

Everything is started here and measured in the same run (docs/design.md §14, issue 18):
  * a throwaway Postgres (tests.support.pgcluster.PgCluster), migrated to head, pinned to CPU 0;
  * bench/fast_upstream.py, a vLLM-shaped fake answering recorded vLLM responses, pinned to CPU 0;
  * bench/thin_proxy.py (FastAPI + uvicorn + an aiohttp client, no recording) in front of it, pinned to CPU 1;
  * `trajgate serve` against both (capture on: every call is written to Postgres), pinned to CPU 1;
  * the load clients, also on CPU 1.

Scenarios, each run direct-to-upstream, through the thin proxy and through the gateway, with the same client and the
same request:
  * non-stream chat, concurrency 1: latency p50/p99 (a keep-alive raw-socket client in a tight loop; the targets
    take turns in two halves, ABBA, so drift hits all alike; after each half through the gateway its writer catches
    up before another target's turn);
  * non-stream chat, concurrency 64: req/s and latency over a fixed duration (wrk with a Lua script; a Python
    aiohttp client when wrk is not installed — the output says which);
  * stream chat, concurrency 1: time to the first SSE event and to the end of the stream, p50/p99;
  * stream chat, concurrency 64: whole streams per second (the same load tool, the stream request).
Afterwards it checks through SQL that `calls` holds one row per successful gateway request.

    .venv/bin/python bench/gateway_overhead.py            # full run, ~90 s
    .venv/bin/python bench/gateway_overhead.py --quick    # ~45 s
    .venv/bin/python bench/gateway_overhead.py --profile /tmp/gw-prof   # plus py-spy profiles at c=64 and s=64 (+~70 s)
    .venv/bin/python bench/gateway_overhead.py --repeat 3   # three whole runs, then each figure per run and its median

On a shared 2-core machine one run's ratios move by ±20 % with the code unchanged, so a verdict worth keeping is taken
on the medians of several runs (`--repeat`), each run started afresh (its own Postgres, upstream, proxies).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.fast_upstream import FIXTURES, load_fixtures, pick_chat_fixture  # noqa: E402
from tests.support.pgcluster import PgCluster, free_port  # noqa: E402

UPSTREAM_CPU = 0
GATEWAY_CPU = 1
CHAT = "/v1/chat/completions"

# Issue 18's goals: latency added at c=1 (p99, against direct) and throughput at c=64 against the thin proxy.
TARGET_ADDED_P99_MS = 1.0
TARGET_RATIO_TO_THIN = 1.0


@dataclass
class Plan:
    c1_requests: int  # per target, in two halves (run_c1)
    c1_warmup: int
    stream_requests: int
    c64_seconds: float
    c64_warmup_seconds: float
    profile_seconds: float


FULL = Plan(c1_requests=5000, c1_warmup=300, stream_requests=2000, c64_seconds=10,
            c64_warmup_seconds=2, profile_seconds=10)
QUICK = Plan(c1_requests=600, c1_warmup=100, stream_requests=300, c64_seconds=3,
             c64_warmup_seconds=1, profile_seconds=5)


# ---------------------------------------------------------------------------------------------------------------
# Processes


class Processes:
    """Children started in their own sessions, stopped (by pid) on exit, Ctrl-C or error."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.children: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
        log.close()
        self.children.append((name, proc))
        return proc

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.workdir / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
        if proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def stop_all(self) -> None:
        for _, proc in reversed(self.children):
            try:
                self.stop(proc, grace_s=20)
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass


def _children_of(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(entry.name))
    return out


def pin_postgres(cluster: PgCluster, cpus: str, idle: bool = False) -> None:
    """Pin the postmaster (new backends inherit it) and the processes it already forked; with `idle`, also put them
    under SCHED_IDLE (inherited the same way), so that any other task on their core preempts them when it wakes."""
    pid = int((cluster.data / "postmaster.pid").read_text().splitlines()[0])
    for target in [pid, *_children_of(pid)]:
        subprocess.run(["taskset", "-a", "-p", "-c", cpus, str(target)], capture_output=True, check=False)
        if idle:
            os.sched_setscheduler(target, os.SCHED_IDLE, os.sched_param(0))


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not answering after {timeout_s:.0f}s")


def process_ticks(pid: int) -> dict[str, int]:
    """CPU clock ticks (user+system) per thread of a process: `main`, else the thread's OS name (the gateway names
    its threads: trajgate-writer, trajgate-wal-sync, trajgate-db_N summed as trajgate-db) or `thread <tid>`."""
    ticks: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            comm = (task / "comm").read_text().strip()
        except OSError:
            continue
        fields_ = stat.rsplit(")", 1)[1].split()
        if int(task.name) == pid:
            name = "main"
        elif comm.startswith("trajgate-"):
            name = re.sub(r"_\d+$", "", comm)
        else:
            name = f"thread {task.name}"
        ticks[name] = ticks.get(name, 0) + int(fields_[11]) + int(fields_[12])
    return ticks


def gateway_ticks(pid: int) -> dict[str, int]:
    """`process_ticks` of the gateway, plus its writer process's (`--writer-process`) as `writer process`."""
    ticks = process_ticks(pid)
    for child in _writer_processes(pid):
        ticks["writer process"] = ticks.get("writer process", 0) + sum(process_ticks(child).values())
    return ticks


def _writer_processes(pid: int) -> list[int]:
    found = []
    for child in _children_of(pid):
        try:
            if b"gateway.recorder.writer_process" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
        except OSError:
            continue
    return found


def all_ticks() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, user+system ticks) for every process on the machine."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields_ = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(entry.name)] = (int(fields_[1]), int(fields_[11]) + int(fields_[12]))
    return out


def foreign_cpu_s(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]], ours: set[int]) -> float:
    """CPU seconds that processes this run did not start used between two snapshots: the background noise."""

    def mine(pid: int) -> bool:
        seen = 0
        while pid > 1 and seen < 64:
            if pid in ours:
                return True
            pid = after.get(pid, before.get(pid, (0, 0)))[0]
            seen += 1
        return False

    used = sum(t - before.get(pid, (0, 0))[1] for pid, (_, t) in after.items() if not mine(pid))
    return used / os.sysconf("SC_CLK_TCK")


def cpu_availability(cpu: int, seconds: float = 0.5) -> tuple[float, float]:
    """Spin on one CPU and see how much of the time this process actually ran: (fraction, longest gap ms).

    Background processes, kernel work or the hypervisor taking the CPU away show up as gaps; they hit the direct
    and the gateway measurements alike and dominate p99 on a busy machine."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        clock = time.perf_counter_ns
        first = clock()
        end = first + int(seconds * 1e9)
        last = first
        lost = longest = 0
        while last < end:
            now = clock()
            gap = now - last
            if gap > 50_000:
                lost += gap
                longest = max(longest, gap)
            last = now
        return 1 - lost / (last - first), longest / 1e6  # over the time it took: a gap may overrun the end
    finally:
        os.sched_setaffinity(0, before)


def metrics_text(base: str) -> str:
    """The gateway's /metrics page."""
    with urllib.request.urlopen(base + "/metrics", timeout=5) as response:
        return str(response.read().decode())


def metrics_counter(base: str, text: str | None = None) -> dict[str, float]:
    """`trajgate_requests_total` by status, from the gateway's /metrics (or that page's `text`)."""
    text = metrics_text(base) if text is None else text
    out: Counter[str] = Counter()
    for match in re.finditer(r'^trajgate_requests_total\{([^}]*)\} ([0-9.e+]+)$', text, re.M):
        status = re.search(r'status="([^"]*)"', match[1])
        out[status[1] if status else "?"] += float(match[2])
    return dict(out)


def writer_state(base: str, text: str | None = None) -> dict[str, float]:
    """The writer's queue depth and its logged, written, spooled and replayed record counts, from the gateway's
    /metrics (or that page's `text`): whether it kept up with a load window (a queue that fills spills records to the
    spool, replayed later, outside the window)."""
    text = metrics_text(base) if text is None else text
    names = {"trajgate_writer_queue_depth": "queue", "trajgate_records_logged_total": "logged",
             "trajgate_records_written_total": "written", "trajgate_records_spooled_total": "spooled",
             "trajgate_records_replayed_total": "replayed", "trajgate_writer_relief_turns_total": "relief"}
    return {key: float(m[1]) for name, key in names.items()
            if (m := re.search(rf"^{name} ([0-9.e+]+)$", text, re.M))}


def drain_writer(base: str, url: str, timeout_s: float = 60.0) -> float:
    """Wait until every record logged so far is written, the batch in flight included (or `timeout_s`); the seconds
    it took. Called before a measured window, so that it starts with no backlog, and after it, so that the writer's
    catch-up is counted with the window's CPU.

    The gateway is asked (/metrics) only to learn the target and to confirm it was reached: a scrape costs the
    gateway CPU (2.4 ms on an idle one: rendering every series, a per-run read of the database), and polling it
    every 50 ms through a catch-up put the benchmark's own observation into the CPU counted for the writer (0.18 s of
    the 0.45 s counted in a --quick run). In between, the rows are counted in Postgres, whose CPU is not the gateway's. Every record of this
    benchmark is one `calls` row of a call answered 200 (the capture check below holds it to that)."""
    import psycopg

    started = time.monotonic()
    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
        while time.monotonic() - started < timeout_s:
            page = metrics_text(base)
            state = writer_state(base, page)
            if state.get("queue", 0) == 0 and state.get("written", 0) >= state.get("logged", 0):
                break
            served = metrics_counter(base, page).get("200", 0)
            while time.monotonic() - started < timeout_s:
                rows = conn.execute("SELECT count(*) FROM calls").fetchone()[0]  # type: ignore[index]
                if rows >= served:
                    break
                time.sleep(0.02)
            else:
                break
            time.sleep(0.02)  # the rows are committed; the writer's counters follow the commit
    return time.monotonic() - started


# ---------------------------------------------------------------------------------------------------------------
# Concurrency-1 client: keep-alive raw socket, a tight loop


class RawConnection:
    """One keep-alive HTTP/1.1 connection; `call` returns (status, ns to the first SSE event, ns to the end)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def request(self, path: str, body: bytes) -> bytes:
        return (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body

    def call(self, request: bytes) -> tuple[int, int, int]:
        sock = self.sock
        perf = time.perf_counter_ns
        started = perf()
        sock.sendall(request)
        buf = b""
        while True:
            data = sock.recv(262144)
            if not data:
                raise ConnectionError("server closed the connection")
            buf += data
            head_end = buf.find(b"\r\n\r\n")
            if head_end >= 0:
                break
        status = int(buf[9:12])
        head = buf[:head_end].lower()
        body_start = head_end + 4
        first = 0
        if b"transfer-encoding: chunked" in head:
            while True:
                if not first and buf.find(b"data:", body_start) >= 0:
                    first = perf()
                if buf.endswith(b"\r\n0\r\n\r\n"):  # the last chunk (also right after an empty head)
                    break
                data = sock.recv(262144)
                if not data:
                    raise ConnectionError("server closed the connection mid-stream")
                buf += data
        else:
            match = re.search(rb"\r\ncontent-length: *(\d+)", head)
            length = int(match[1]) if match else 0
            while len(buf) - body_start < length:
                data = sock.recv(262144)
                if not data:
                    raise ConnectionError("server closed the connection mid-body")
                buf += data
        end = perf()
        return status, (first - started) if first else 0, end - started

    def close(self) -> None:
        self.sock.close()

    def reconnect(self) -> None:
        """A new connection: one left idle while other targets take their turn may pass its server's keep-alive
        timeout (uvicorn's is 5 s)."""
        self.sock.close()
        self.sock = socket.create_connection(("127.0.0.1", self.port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


@dataclass
class Samples:
    latency_ns: list[int] = field(default_factory=list)
    first_ns: list[int] = field(default_factory=list)
    ok: int = 0
    failed: Counter[int] = field(default_factory=Counter)
    elapsed_ns: int = 0


def run_c1(targets: dict[str, tuple[RawConnection, bytes]], per_target: int, block: int, warmup: int,
           stream: bool, after_block: Callable[[str], None] = lambda name: None) -> dict[str, Samples]:
    """Alternate blocks of requests between targets (ABBA order); warm-up requests are not sampled. Each block starts
    on a new connection with one call not sampled. `after_block` runs after each block with its target's name,
    outside the measurement."""
    samples = {name: Samples() for name in targets}
    for name, (conn, request) in targets.items():
        for _ in range(warmup):
            status, _, _ = conn.call(request)
            samples[name].ok += status == 200  # warm-up counts for the capture check, not for latency
    names = list(targets)
    done = 0
    round_ = 0
    while done < per_target:
        size = min(block, per_target - done)
        order = names if round_ % 2 == 0 else names[::-1]
        for name in order:
            conn, request = targets[name]
            s = samples[name]
            conn.reconnect()
            status, _, _ = conn.call(request)
            s.ok += status == 200
            block_started = time.perf_counter_ns()
            for _ in range(size):
                status, first, total = conn.call(request)
                if status == 200:
                    s.ok += 1
                    s.latency_ns.append(total)
                    if stream:
                        s.first_ns.append(first)
                else:
                    s.failed[status] += 1
            s.elapsed_ns += time.perf_counter_ns() - block_started
            after_block(name)
        done += size
        round_ += 1
    return samples


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


# ---------------------------------------------------------------------------------------------------------------
# Concurrency-64 load: wrk (or aiohttp when wrk is missing)

WRK_SCRIPT = r"""
threads = {}
sent = 0
local req

function setup(thread)
  table.insert(threads, thread)
end

function init(args)
  local f = assert(io.open("%(body_path)s", "rb"))
  local body = f:read("*a")
  f:close()
  req = wrk.format("POST", "%(path)s", {["Content-Type"] = "application/json"}, body)
end

function request()
  sent = sent + 1
  return req
end

function done(summary, latency, requests)
  local total_sent = 0
  for _, t in ipairs(threads) do
    total_sent = total_sent + t:get("sent")
  end
  local e = summary.errors
  io.write(string.format(
    'WRK_RESULT {"requests": %%d, "duration_us": %%d, "sent": %%d, "status": %%d, "connect": %%d, ' ..
    '"read": %%d, "write": %%d, "timeout": %%d, "p50_us": %%d, "p99_us": %%d, "mean_us": %%f}\n',
    summary.requests, summary.duration, total_sent, e.status, e.connect, e.read, e.write, e.timeout,
    latency:percentile(50), latency:percentile(99), latency.mean))
end
"""


@dataclass
class LoadResult:
    tool: str
    requests: int  # completed
    ok: int  # completed with 2xx
    in_flight: int  # sent but not completed when the load stopped (the gateway still answers and records them)
    seconds: float
    p50_ms: float
    p99_ms: float
    errors: dict[str, int]

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def run_wrk(wrk: str, port: int, body_path: Path, workdir: Path, connections: int, seconds: float,
            tag: str) -> LoadResult:
    script = workdir / f"wrk_{tag}.lua"
    script.write_text(WRK_SCRIPT % {"body_path": str(body_path), "path": CHAT})
    argv = ["taskset", "-c", str(GATEWAY_CPU), wrk, "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s",
            "--timeout", "10s", "-s", str(script), f"http://127.0.0.1:{port}{CHAT}"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60)
    match = re.search(r"^WRK_RESULT (\{.*\})$", proc.stdout, re.M)
    if proc.returncode != 0 or match is None:
        raise RuntimeError(f"wrk failed ({proc.returncode}): {proc.stdout[-2000:]} {proc.stderr[-2000:]}")
    r = json.loads(match[1])
    errors = {k: r[k] for k in ("status", "connect", "read", "write", "timeout") if r[k]}
    return LoadResult(
        tool="wrk",
        requests=r["requests"],
        ok=r["requests"] - r["status"],
        in_flight=max(0, r["sent"] - r["requests"]),
        seconds=r["duration_us"] / 1e6,
        p50_ms=r["p50_us"] / 1000,
        p99_ms=r["p99_us"] / 1000,
        errors=errors,
    )


def run_aiohttp(port: int, body: bytes, connections: int, seconds: float) -> LoadResult:
    import aiohttp

    async def load() -> LoadResult:
        latencies: list[int] = []
        statuses: Counter[int] = Counter()
        url = f"http://127.0.0.1:{port}{CHAT}"
        headers = {"content-type": "application/json"}
        connector = aiohttp.TCPConnector(limit=connections)
        async with aiohttp.ClientSession(connector=connector) as session:
            deadline = time.perf_counter() + seconds

            async def worker() -> None:
                while time.perf_counter() < deadline:
                    started = time.perf_counter_ns()
                    async with session.post(url, data=body, headers=headers) as response:
                        await response.read()
                    latencies.append(time.perf_counter_ns() - started)
                    statuses[response.status] += 1

            started = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(connections)))
            elapsed = time.perf_counter() - started
        ok = sum(n for status, n in statuses.items() if 200 <= status < 300)
        ms = [v / 1e6 for v in latencies]
        return LoadResult("aiohttp client (no wrk)", len(latencies), ok, 0, elapsed, pct(ms, 50), pct(ms, 99),
                          {f"status {s}": n for s, n in statuses.items() if not 200 <= s < 300})

    try:
        import uvloop

        return uvloop.run(load())
    except ImportError:
        return asyncio.run(load())


# ---------------------------------------------------------------------------------------------------------------
# Profile (py-spy) of the gateway under c=64


def summarise_profile(raw: Path, title: str, top: int = 20) -> str:
    """Self and inclusive time per function from py-spy's collapsed stacks (`--format raw`)."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    by_thread: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = stack.split(";")
        total += count
        if frames[0].startswith("thread ("):
            by_thread[_thread_label(frames)] += count
            frames = frames[1:]
        own[_short(frames[-1])] += count
        for frame in {_short(f) for f in frames}:
            inclusive[frame] += count
    if not total:
        return f"profile ({title}): no samples"
    lines = [f"profile ({title}): {total} samples"]
    if by_thread:
        lines.append("  by thread:")
        lines += [f"    {100 * n / total:5.1f}%  {name}" for name, n in by_thread.most_common(6)]
    lines.append("  self time:")
    lines += [f"    {100 * n / total:5.1f}%  {name}" for name, n in own.most_common(top)]
    lines.append("  inclusive time:")
    lines += [f"    {100 * n / total:5.1f}%  {name}" for name, n in inclusive.most_common(top + 15)]
    return "\n".join(lines)


def _thread_label(frames: list[str]) -> str:
    joined = ";".join(frames)
    if "Thread._bootstrap" in joined:
        for frame in frames:
            if "._run" in frame or ".run " in frame:
                return f"{frames[0]} {_short(frame)}"
        return f"{frames[0]} (other thread)"
    return f"{frames[0]} (event loop)"


def _short(frame: str) -> str:
    """`func (path/to/file.py:123)` -> `func (file.py)` so lines of one function add up."""
    match = re.match(r"^(.*?) \((.*?)(?::\d+)?\)$", frame)
    if not match:
        return frame
    path = match[2]
    for marker in ("site-packages/", "/work/main/", "lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{match[1]} ({path})"


# ---------------------------------------------------------------------------------------------------------------
# The run


def client_bodies(fixtures: dict[str, dict[str, Any]]) -> tuple[str, bytes, bytes]:
    """What an agent sends: the recorded request minus what the gateway injects, max_tokens 16, run `bench`."""
    name = pick_chat_fixture(fixtures, 16)
    request = dict(fixtures[name]["request"])
    served_model = fixtures[name]["response"]["model"]
    for injected in ("logprobs", "return_token_ids", "top_logprobs"):
        request.pop(injected, None)
    request["model"] = "bench"
    request["max_tokens"] = 16
    plain = json.dumps(request, separators=(",", ":")).encode()
    stream = json.dumps({**request, "stream": True, "stream_options": {"include_usage": True}},
                        separators=(",", ":")).encode()
    return served_model, plain, stream


def ms(ns_values: list[int]) -> list[float]:
    return [v / 1e6 for v in ns_values]


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


# The figures `--repeat` summarises: label, where each run's JSON has it, where the thin proxy's own figure is (for
# added latency), and how its median is judged: "p99" added latency against TARGET_ADDED_P99_MS, "rate" a ratio to the
# thin proxy that must reach TARGET_RATIO_TO_THIN, "cpu" a ratio to the thin proxy that must stay below 1.
_REPEATED: tuple[tuple[str, tuple[str, str], tuple[str, str] | None, str], ...] = (
    ("c=1 added p99 ms", ("c1", "gateway_added_p99_ms"), ("c1", "thin_added_p99_ms"), "p99"),
    ("c=64 req/s x thin", ("c64", "ratio_to_thin"), None, "rate"),
    ("s=1 first event added p99 ms", ("stream", "gateway_added_p99_ms"), ("stream", "thin_added_p99_ms"), "p99"),
    ("s=64 streams/s x thin", ("s64", "ratio_to_thin"), None, "rate"),
    ("CPU per request x thin", ("cpu_per_request_us", "ratio_to_thin"), None, "cpu"),
    ("CPU per stream x thin", ("cpu_per_stream_us", "ratio_to_thin"), None, "cpu"),
)


def summarise_repeats(runs: list[dict[str, Any]]) -> tuple[list[str], bool]:
    """Each figure of `runs` (the JSON results of whole runs) per run, its median and the verdict on the median; the
    capture check must hold in every run. Returns the table's lines and whether every verdict passed."""
    lines = [f"{len(runs)} runs: each figure per run, its median, the goal judged on the median"]
    header = ["figure", *(f"run {i + 1}" for i in range(len(runs))), "median", "thin median", "goal", ""]
    rows = []
    all_ok = True
    for label, (section, key), thin_at, kind in _REPEATED:
        values = [float(run[section][key]) for run in runs]
        median = statistics.median(values)
        thin = statistics.median(float(run[thin_at[0]][thin_at[1]]) for run in runs) if thin_at else None
        if kind == "p99":
            ok, goal = median <= TARGET_ADDED_P99_MS, f"<= {TARGET_ADDED_P99_MS:.1f} ms"
        elif kind == "rate":
            ok, goal = median >= TARGET_RATIO_TO_THIN, f">= {TARGET_RATIO_TO_THIN:.1f}x"
        else:
            ok, goal = median < 1.0, "< 1.0x"
        all_ok = all_ok and ok
        form = "+{:.3f}" if kind == "p99" else "{:.2f}x"
        rows.append([label, *(form.format(v) for v in values), form.format(median),
                     form.format(thin) if thin is not None else "", goal, verdict(ok)])
    captured = [bool(run["capture"]["match"]) for run in runs]
    all_ok = all_ok and all(captured)
    rows.append(["capture check", *("PASS" if c else "MISMATCH" for c in captured), "", "", "every run",
                 verdict(all(captured))])
    return lines + text_table(header, rows), all_ok


def text_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Columns padded to their widest cell, a rule under the header: one run's table and the repeats' summary."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(), "  ".join("-" * w for w in widths)]
    return lines + ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _without_options(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """`argv` less the options `names` and their values (as `--name value` or `--name=value`)."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        elif not arg.startswith(tuple(f"{name}=" for name in names)):
            kept.append(arg)
    return kept


def _repeat(args: argparse.Namespace, argv: list[str]) -> int:
    """Whole runs one after another, each in a fresh interpreter with processes of its own, then the summary."""
    child = _without_options(argv, ("--repeat", "--json"))
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="trajgate-bench-repeat-") as scratch:
        for index in range(args.repeat):
            out = Path(scratch) / f"run-{index + 1}.json"
            print(f"\n=== run {index + 1} of {args.repeat} ===", flush=True)
            code = subprocess.call([sys.executable, str(Path(__file__).resolve()), *child, "--json", str(out)])
            if code == 130:
                return code
            if not out.exists():
                print(f"run {index + 1} ended with exit code {code} and no results", file=sys.stderr)
                return code or 1
            runs.append(json.loads(out.read_text()))
    lines, ok = summarise_repeats(runs)
    print()
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "summary": lines, "pass": ok}, indent=1))
    return 0 if all(run["capture"]["match"] for run in runs) else 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short run (~45 s)")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="after the measurements, profile the gateway with py-spy under c=64 (DIR/gateway.svg, "
                             "DIR/gateway.txt collapsed stacks, summary printed)")
    parser.add_argument("--connections", type=int, default=64, help="concurrency of the throughput scenario")
    parser.add_argument("--no-wrk", action="store_true", help="use the aiohttp client even when wrk is installed")
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs, spool) for inspection")
    parser.add_argument("--nice", type=int, default=0,
                        help="run everything at this niceness (children inherit it); a negative value (root only) "
                             "makes a shared machine's background load matter less, at the other processes' expense")
    parser.add_argument("--writer-process", action="store_true",
                        help="run the gateway with TRAJGATE_WRITER_PROCESS=true (its database work in a process of "
                             "its own); its CPU is counted with the gateway's")
    parser.add_argument("--writer-cpu", type=int, metavar="N",
                        help="with --writer-process: pin the writer process to CPU N (default: the gateway's CPU, "
                             "which it inherits); the upstream's CPU is the spare core of this layout")
    parser.add_argument("--writer-nice", type=int, default=None, metavar="N",
                        help="run the gateway with TRAJGATE_WRITER_NICE=N: its writer thread (and process) N lower in "
                             "OS priority than the event loop (default: the gateway's, 19, with its relief thread; 0: "
                             "one writer thread at the event loop's priority)")
    parser.add_argument("--postgres-idle", action="store_true",
                        help="run Postgres under SCHED_IDLE on the upstream's core, so the fake upstream (vLLM's "
                             "stand-in) is never kept waiting by the database's work on the gateway's batches; by "
                             "default they share the core at one priority, as two services on one small machine")
    parser.add_argument("--gateway-env", action="append", default=[], metavar="TRAJGATE_NAME=VALUE",
                        help="a setting for the gateway (repeatable), e.g. TRAJGATE_WRITER_BATCH_SIZE=32: the "
                             "gateway otherwise gets none of this shell's TRAJGATE_ variables, only the benchmark's")
    parser.add_argument("--upstream-suffix", default="/v1",
                        help="appended to the fake upstream's address for TRAJGATE_UPSTREAM_URL (default /v1)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="N whole runs, each with fresh processes, then every figure per run and its median; "
                             "the goals are judged on the medians (--json then holds every run and the summary)")
    raw_argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(raw_argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    for setting in args.gateway_env:
        if not setting.startswith("TRAJGATE_") or "=" not in setting:
            parser.error(f"--gateway-env {setting!r}: expected TRAJGATE_NAME=VALUE")
    if args.repeat > 1:
        if args.profile:
            parser.error("--profile profiles one run; use it without --repeat")
        return _repeat(args, raw_argv)
    plan = QUICK if args.quick else FULL
    if args.nice:
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)  # before any child starts, so all of them inherit it
    if (os.cpu_count() or 1) < 2:
        print("note: fewer than 2 CPUs; pinning is skipped", file=sys.stderr)

    def _terminate(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started from a shell that ignores it
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)

    workdir = Path(tempfile.mkdtemp(prefix="trajgate-bench-"))
    procs = Processes(workdir)
    clusters: list[PgCluster] = []
    started_all = time.monotonic()
    try:
        return _run(args, plan, workdir, procs, started_all, clusters)
    except KeyboardInterrupt:
        print("\ninterrupted; cleaning up", file=sys.stderr)
        return 130
    finally:
        procs.stop_all()
        for cluster in clusters:
            cluster.destroy()
        if args.keep:
            print(f"work dir kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def _run(args: argparse.Namespace, plan: Plan, workdir: Path, procs: Processes, started_all: float,
         clusters: list[PgCluster]) -> int:
    fixtures = load_fixtures(FIXTURES)
    served_model, plain_body, stream_body = client_bodies(fixtures)
    body_path = workdir / "body.json"
    body_path.write_bytes(plain_body)
    stream_body_path = workdir / "stream_body.json"
    stream_body_path.write_bytes(stream_body)
    two_cpus = (os.cpu_count() or 1) >= 2
    pin = (lambda cpu: ["taskset", "-c", str(cpu)]) if two_cpus else (lambda cpu: [])

    # Postgres
    t0 = time.monotonic()
    cluster = PgCluster()
    clusters.append(cluster)
    cluster.start()
    if two_cpus:
        pin_postgres(cluster, str(UPSTREAM_CPU), idle=args.postgres_idle)
    url = cluster.url()
    from gateway.store import db

    db.upgrade(url)
    print(f"postgres {cluster.port} up and migrated in {time.monotonic() - t0:.1f}s", flush=True)

    # fake upstream on CPU 0
    up_port = free_port()
    upstream = procs.start("upstream", [*pin(UPSTREAM_CPU), sys.executable, str(REPO / "bench" / "fast_upstream.py"),
                                        "--port", str(up_port)])
    wait_http(f"http://127.0.0.1:{up_port}/v1/models", upstream, 20)
    print(procs.log_tail("upstream", 1), flush=True)

    # the thin reference proxy on the gateway's CPU
    thin_port = free_port()
    thin = procs.start("thin", [*pin(GATEWAY_CPU), sys.executable, str(REPO / "bench" / "thin_proxy.py"),
                                "--port", str(thin_port), "--upstream", f"http://127.0.0.1:{up_port}"])
    wait_http(f"http://127.0.0.1:{thin_port}/health", thin, 30)

    # the gateway on CPU 1
    gw_port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJGATE_")}
    env.update(
        TRAJGATE_DATABASE_URL=url,
        TRAJGATE_UPSTREAM_URL=f"http://127.0.0.1:{up_port}{args.upstream_suffix}",
        TRAJGATE_BASE_MODEL=served_model,
        TRAJGATE_SPOOL_DIR=str(workdir / "spool"),
        TRAJGATE_CHECKPOINT_DIR=str(workdir / "checkpoints"),
    )
    if args.writer_process:
        env["TRAJGATE_WRITER_PROCESS"] = "true"
    if args.writer_nice is not None:
        env["TRAJGATE_WRITER_NICE"] = str(args.writer_nice)
    env.update(setting.split("=", 1) for setting in args.gateway_env)
    trajgate = Path(sys.executable).parent / "trajgate"
    command = [str(trajgate)] if trajgate.exists() else [sys.executable, "-m", "gateway.cli"]
    t0 = time.monotonic()
    gateway = procs.start("gateway", [*pin(GATEWAY_CPU), *command, "serve", "--port", str(gw_port),
                                      "--log-level", "warning"], env=env, cwd=workdir)
    gw_base = f"http://127.0.0.1:{gw_port}"
    try:
        wait_http(gw_base + "/health", gateway, 60)
    except RuntimeError as exc:
        print(f"gateway did not start: {exc}\n--- gateway log ---\n{procs.log_tail('gateway')}", file=sys.stderr)
        return 1
    print(f"trajgate serve up in {time.monotonic() - t0:.1f}s (pid {gateway.pid}, CPU {GATEWAY_CPU}); "
          f"client on CPU {GATEWAY_CPU}; upstream and postgres on CPU {UPSTREAM_CPU}"
          + ("; postgres under SCHED_IDLE" if args.postgres_idle else "")
          + (f"; writer nice {args.writer_nice}" if args.writer_nice is not None else ""), flush=True)
    if args.writer_process:
        deadline = time.monotonic() + 20
        while not (children := _writer_processes(gateway.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not children:
            print("the gateway started no writer process", file=sys.stderr)
            return 1
        if args.writer_cpu is not None:
            for child in children:
                os.sched_setaffinity(child, {args.writer_cpu})
        where = f"CPU {args.writer_cpu}" if args.writer_cpu is not None else f"the gateway's CPU {GATEWAY_CPU}"
        print(f"writer process {children[0]} on {where}", flush=True)
    if two_cpus:
        os.sched_setaffinity(0, {GATEWAY_CPU})
    probe = RawConnection(gw_port)
    status, _, _ = probe.call(probe.request(CHAT, plain_body))
    probe.close()
    if status != 200:
        print(f"a chat call through the gateway answered {status}, not 200; not benchmarking errors.\n"
              f"--- upstream log ---\n{procs.log_tail('upstream', 5)}", file=sys.stderr)
        return 2

    gateway_ok = 1  # successful gateway requests, client-counted (the probe above is the first)
    gateway_in_flight = 0  # sent but not seen completing when a load tool stopped
    postmaster = int((cluster.data / "postmaster.pid").read_text().splitlines()[0])
    ours = {os.getpid(), gateway.pid, upstream.pid, postmaster, thin.pid}
    availability = {cpu: cpu_availability(cpu) for cpu in ((UPSTREAM_CPU, GATEWAY_CPU) if two_cpus else (0,))}
    print("CPU availability probe (0.5 s spin): " + ", ".join(
        f"CPU {cpu} {100 * share:.0f}% (longest gap {gap:.1f} ms)" for cpu, (share, gap) in availability.items()),
        flush=True)
    noise_before, noise_started = all_ticks(), time.monotonic()

    # 1. non-stream, c=1
    conns = {"direct": RawConnection(up_port), "thin": RawConnection(thin_port), "gateway": RawConnection(gw_port)}
    targets = {name: (conn, conn.request(CHAT, plain_body)) for name, conn in conns.items()}
    # Each target's calls in two halves, ABBA, so drift hits all alike; after each half through the gateway its writer
    # catches up before another target's turn. With blocks of 250 and no wait, the next target's block ran beside the
    # gateway writing the records of the one before: that put the thin proxy's c=1 p99 at +2.1 ms where with the
    # gateway idle it is +0.9-1.4, and the gateway's writer, leaving a block's records to whoever came next, never had
    # to keep up with its own calls. In halves of 2,500 it must; what it has left at the end of each is printed.
    def catching_up(seconds: list[float]) -> Callable[[str], None]:
        def after_block(name: str) -> None:
            if name == "gateway":
                seconds.append(drain_writer(gw_base, url))

        return after_block

    c1_catch_up: list[float] = []
    t0 = time.monotonic()
    c1 = run_c1(targets, plan.c1_requests, (plan.c1_requests + 1) // 2, plan.c1_warmup, stream=False,
                after_block=catching_up(c1_catch_up))
    gateway_ok += c1["gateway"].ok
    print(f"non-stream c=1: {plan.c1_requests} requests per target in {time.monotonic() - t0:.1f}s (the gateway's "
          f"writer caught up {', '.join(f'{s:.2f}' for s in c1_catch_up)} s after each half)", flush=True)

    # 2. stream, c=1
    stream_targets = {name: (conn, conn.request(CHAT, stream_body)) for name, conn in conns.items()}
    t0 = time.monotonic()
    st_catch_up: list[float] = []
    st = run_c1(stream_targets, plan.stream_requests, (plan.stream_requests + 1) // 2, plan.c1_warmup // 2,
                stream=True, after_block=catching_up(st_catch_up))
    gateway_ok += st["gateway"].ok
    print(f"stream c=1: {plan.stream_requests} streams per target in {time.monotonic() - t0:.1f}s (the gateway's "
          f"writer caught up {', '.join(f'{s:.2f}' for s in st_catch_up)} s after each half)", flush=True)
    for conn in conns.values():
        conn.close()

    # 3. non-stream, c=64
    wrk = None if args.no_wrk else shutil.which("wrk")

    def load(port: int, seconds: float, tag: str, stream: bool = False) -> LoadResult:
        if wrk:
            return run_wrk(wrk, port, stream_body_path if stream else body_path, workdir, args.connections,
                           seconds, tag)
        return run_aiohttp(port, stream_body if stream else plain_body, args.connections, seconds)

    load(up_port, plan.c64_warmup_seconds, "direct_warmup")
    direct64 = load(up_port, plan.c64_seconds, "direct")
    load(thin_port, plan.c64_warmup_seconds, "thin_warmup")
    thin_ticks_before = sum(process_ticks(thin.pid).values())
    thin64 = load(thin_port, plan.c64_seconds, "thin")
    thin_cpu_total = (sum(process_ticks(thin.pid).values()) - thin_ticks_before) / os.sysconf("SC_CLK_TCK")
    warm = load(gw_port, plan.c64_warmup_seconds, "gateway_warmup")
    gateway_ok += warm.ok
    gateway_in_flight += warm.in_flight
    drain_writer(gw_base, url)
    gw_ticks_before = gateway_ticks(gateway.pid)
    up_ticks_before = sum(process_ticks(upstream.pid).values())
    writer_at: dict[str, dict[str, float]] = {"before c64": writer_state(gw_base)}
    gw64 = load(gw_port, plan.c64_seconds, "gateway")
    gw_ticks_after = gateway_ticks(gateway.pid)
    up_ticks_after = sum(process_ticks(upstream.pid).values())
    writer_at["after c64"] = writer_state(gw_base)
    catch_up_s = {"c64": drain_writer(gw_base, url)}
    gw_ticks_caught_up = gateway_ticks(gateway.pid)
    gateway_ok += gw64.ok
    gateway_in_flight += gw64.in_flight
    print(f"non-stream c={args.connections}: {direct64.tool}, {plan.c64_seconds:.0f}s per target", flush=True)

    # 4. stream, c=64: whole streams per second
    s64: dict[str, LoadResult] = {}
    s64_cpu_s: dict[str, float] = {}
    for name, port, pid in (("direct", up_port, upstream.pid), ("thin", thin_port, thin.pid),
                            ("gateway", gw_port, gateway.pid)):
        warm = load(port, plan.c64_warmup_seconds, f"s64_{name}_warmup", stream=True)
        ticks_of = gateway_ticks if name == "gateway" else process_ticks
        if name == "gateway":
            drain_writer(gw_base, url)
        ticks_before = sum(ticks_of(pid).values())
        if name == "gateway":
            writer_at["before s64"] = writer_state(gw_base)
        s64[name] = load(port, plan.c64_seconds, f"s64_{name}", stream=True)
        if name == "gateway":
            writer_at["after s64"] = writer_state(gw_base)
            catch_up_s["s64"] = drain_writer(gw_base, url)
        s64_cpu_s[name] = (sum(ticks_of(pid).values()) - ticks_before) / os.sysconf("SC_CLK_TCK")
        if name == "gateway":
            gateway_ok += warm.ok + s64[name].ok
            gateway_in_flight += warm.in_flight + s64[name].in_flight
    print(f"stream c={args.connections}: {plan.c64_seconds:.0f}s per target", flush=True)

    hz = os.sysconf("SC_CLK_TCK")
    gw_cpu = {name: (gw_ticks_after.get(name, 0) - gw_ticks_before.get(name, 0)) / hz for name in gw_ticks_after}
    gw_cpu = {name: seconds for name, seconds in gw_cpu.items() if seconds > 0}
    gw_cpu_window = sum(gw_cpu.values())
    # What the gateway's CPU per request is judged on: the window and the writer's catch-up after it.
    gw_cpu_total = sum(gw_ticks_caught_up.values()) / hz - sum(gw_ticks_before.values()) / hz
    up_cpu_total = (up_ticks_after - up_ticks_before) / hz
    noise_s = foreign_cpu_s(noise_before, all_ticks(), ours)
    noise_pct = 100 * noise_s / ((time.monotonic() - noise_started) * (os.cpu_count() or 1))

    # 5. optional profiles under the same c=64 loads
    profile_summary = None
    if args.profile:
        profile_summary, prof_ok, prof_in_flight = _profile(args, plan, procs, gateway.pid, gw_port, load)
        gateway_ok += prof_ok
        gateway_in_flight += prof_in_flight

    # capture check: one `calls` row per successful gateway request. The gateway's own counter is exact; the
    # clients know theirs exactly except for requests wrk had sent when it stopped (the gateway may still have
    # answered, and so recorded, each of those).
    time.sleep(0.5)
    served = int(metrics_counter(gw_base).get("200", 0))
    rows, stats, waited = _wait_for_rows(url, served, timeout_s=60)
    counter = metrics_counter(gw_base)
    served = int(counter.get("200", 0))

    results = _table(args, plan, c1, st, {"direct": direct64, "thin": thin64, "gateway": gw64}, s64,
                     {"thin": 1e6 * thin_cpu_total / max(thin64.requests, 1),
                      "gateway": 1e6 * gw_cpu_total / max(gw64.requests, 1)},
                     {name: 1e6 * s64_cpu_s[name] / max(s64[name].requests, 1) for name in ("thin", "gateway")})
    print()
    per_request = {name: 1e6 * seconds / max(gw64.requests, 1) for name, seconds in gw_cpu.items()}
    threads = ", ".join(f"{'event loop' if name == 'main' else name} {us:.0f}"
                        for name, us in sorted(per_request.items(), key=lambda item: -item[1]))
    threads = f"us per request by thread: {threads}"
    caught = {name: (gw_ticks_caught_up.get(name, 0) - gw_ticks_after.get(name, 0)) / hz for name in gw_ticks_caught_up}
    caught_threads = ", ".join(f"{'event loop' if name == 'main' else name} {seconds:.2f}"
                               for name, seconds in sorted(caught.items(), key=lambda item: -item[1]) if seconds > 0)
    print(f"gateway CPU during the c={args.connections} gateway run: {gw_cpu_window:.2f} s over {gw64.seconds:.1f} s "
          f"({100 * gw_cpu_window / gw64.seconds:.0f}% of a core, {1e6 * gw_cpu_window / max(gw64.requests, 1):.0f} us "
          f"per request; {threads}), then {gw_cpu_total - gw_cpu_window:.2f} s while the writer caught up "
          f"({catch_up_s['c64']:.1f} s; by thread: {caught_threads}; {1e6 * gw_cpu_total / max(gw64.requests, 1):.0f} us per request in all, the "
          f"figure in the table); upstream {up_cpu_total:.2f}s; the thin proxy used {thin_cpu_total:.2f} s "
          f"over {thin64.seconds:.1f} s ({1e6 * thin_cpu_total / max(thin64.requests, 1):.0f} us per request)")
    print(f"background: processes outside this benchmark used {noise_pct:.0f}% of the machine's CPU during the "
          f"measurements (load average now {os.getloadavg()[0]:.2f}; this run's niceness {os.getpriority(os.PRIO_PROCESS, 0)})" + ("  <- noisy, numbers are pessimistic"
                                                                           if noise_pct > 5 else ""))
    # A writer that fell behind did part of its work after the window (its catch-up is counted in CPU per request
    # and per stream), and spilled records cost a replay.
    kept_up = []
    for window in ("c64", "s64"):
        before, after = writer_at[f"before {window}"], writer_at[f"after {window}"]
        spilled = after.get("spooled", 0) - before.get("spooled", 0)
        relief = after.get("relief", 0) - before.get("relief", 0)
        kept_up.append(f"{window}: queue {after.get('queue', 0):,.0f} at the end, {spilled:,.0f} spilled, "
                       f"caught up {catch_up_s[window]:.1f} s later"
                       + (f", {relief:,.0f} relief turns" if relief else "")
                       + ("  <- records spilled" if spilled else ""))
    print(f"writer during the gateway's c={args.connections}/s={args.connections} windows: " + "; ".join(kept_up))
    print()
    match = rows == served and gateway_ok <= rows <= gateway_ok + gateway_in_flight
    print(
        f"capture check: calls rows = {rows:,}; successful gateway requests = {served:,} (the gateway's "
        f"trajgate_requests_total{{status=\"200\"}}; clients counted {gateway_ok:,} answered + "
        f"{gateway_in_flight:,} still in flight when wrk stopped); trainable rows {stats['trainable']:,}, "
        f"rows with prompt+completion token ids {stats['with_ids']:,}, stream rows {stats['stream']:,}; "
        f"last row landed {waited:.1f}s after the load ended -> {'PASS' if match else 'MISMATCH'}"
    )
    if counter.keys() - {"200"}:
        print(f"  other statuses from the gateway: {counter}")
    if profile_summary:
        print()
        print(profile_summary)
    print(f"\ntotal run time {time.monotonic() - started_all:.0f}s")
    if args.json:
        results.update(
            capture={"rows": rows, "gateway_counter_200": served, "client_counted": gateway_ok,
                     "in_flight_at_stop": gateway_in_flight, **stats, "match": match},
            gateway_cpu_s=gw_cpu, upstream_cpu_s=up_cpu_total, background_cpu_pct=noise_pct, writer=writer_at,
            writer_catch_up_s=catch_up_s, gateway_cpu_with_catch_up_s=gw_cpu_total,
            cpu_availability={str(cpu): {"share": share, "longest_gap_ms": gap}
                              for cpu, (share, gap) in availability.items()},
        )
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if match else 3


def _profile(args: argparse.Namespace, plan: Plan, procs: Processes, pid: int, gw_port: int,
             load: Any) -> tuple[str, int, int]:
    py_spy = Path(sys.executable).parent / "py-spy"
    py_spy_cmd = str(py_spy) if py_spy.exists() else shutil.which("py-spy")
    if not py_spy_cmd:
        return "profile: py-spy not installed (.venv/bin/pip install py-spy)", 0, 0
    out: Path = args.profile
    out.mkdir(parents=True, exist_ok=True)
    seconds = plan.profile_seconds
    ok = in_flight = 0
    summaries = []
    runs = [
        (f"{scenario}-{tag}", stream, fmt, out / f"gateway-{scenario}{suffix}", extra)
        for scenario, stream in (("c64", False), ("s64", True))
        for tag, fmt, suffix, extra in (
            ("all", "raw", ".txt", ["--threads"]),  # every active thread: event loop and writer
            ("gil", "raw", "-gil.txt", ["--gil"]),  # only the thread holding the GIL: what serialises
            ("svg", "flamegraph", ".svg", []),
        )
    ]
    for tag, stream, fmt, path, extra in runs:
        # Blocking mode (the default): py-spy pauses the process for each sample, so stacks are consistent.
        spy = procs.start(f"py-spy-{tag}", ["taskset", "-c", str(UPSTREAM_CPU), py_spy_cmd, "record", "--pid",
                                            str(pid), "-d", str(int(seconds)), "-r", "100", "-f", fmt, "-o",
                                            str(path), *extra])
        time.sleep(0.5)
        result = load(gw_port, seconds, f"profile_{tag}", stream)
        ok += result.ok
        in_flight += result.in_flight
        try:
            spy.wait(seconds + 30)
        except subprocess.TimeoutExpired:
            procs.stop(spy, 5)
        summaries.append(f"profile run ({tag}): {result.rps:,.0f} req/s under py-spy")
    text = "\n".join(
        summarise_profile(path, f"{scenario}, {title}") for scenario in ("c64", "s64") for title, path in (
            ("active threads", out / f"gateway-{scenario}.txt"), ("GIL holder", out / f"gateway-{scenario}-gil.txt"))
        if path.exists()
    )
    files = (f"profile files: {out}/gateway-{{c64,s64}}.svg, {out}/gateway-{{c64,s64}}.txt, "
             f"{out}/gateway-{{c64,s64}}-gil.txt (collapsed stacks)")
    return "\n".join([*summaries, files, text]), ok, in_flight


def _wait_for_rows(url: str, expected: int, timeout_s: float) -> tuple[int, dict[str, int], float]:
    import psycopg

    plain = url.replace("postgresql+psycopg://", "postgresql://")
    started = time.monotonic()
    rows, last_change, last = 0, started, -1
    query = (
        "SELECT count(*), count(*) FILTER (WHERE trainable), count(*) FILTER (WHERE stream), "
        "count(*) FILTER (WHERE completion_token_ids IS NOT NULL AND prompt_token_ids IS NOT NULL) FROM calls"
    )
    with psycopg.connect(plain, autocommit=True) as conn:
        while True:
            rows, trainable, stream, with_ids = conn.execute(query).fetchone()  # type: ignore[misc]
            now = time.monotonic()
            if rows != last:
                last, last_change = rows, now
            if rows >= expected and now - last_change > 1.0:
                break
            if now - started > timeout_s or (now - last_change > 10):
                break
            time.sleep(0.25)
    return rows, {"trainable": trainable, "stream": stream, "with_ids": with_ids}, last_change - started


def _table(args: argparse.Namespace, plan: Plan, c1: dict[str, Samples], st: dict[str, Samples],
           c64: dict[str, LoadResult], s64: dict[str, LoadResult], cpu_us: dict[str, float],
           stream_cpu_us: dict[str, float]) -> dict[str, Any]:
    """direct | thin | trajgate, side by side, with the issue-18 goals: trajgate at least as good as the thin proxy."""
    names = ("direct", "thin", "gateway")
    rows: list[list[str]] = []
    results: dict[str, Any] = {"plan": plan.__dict__, "load_tool": c64["gateway"].tool}

    def latency_row(label: str, values: dict[str, list[float]], key: str, goal: bool) -> None:
        p50 = {n: pct(values[n], 50) for n in names}
        p99 = {n: pct(values[n], 99) for n in names}
        added = {n: (p50[n] - p50["direct"], p99[n] - p99["direct"]) for n in ("thin", "gateway")}
        ok = added["gateway"][1] <= TARGET_ADDED_P99_MS
        rows.append([label, f"{p50['direct']:.3f} / {p99['direct']:.3f}", f"{p50['thin']:.3f} / {p99['thin']:.3f}",
                     f"{p50['gateway']:.3f} / {p99['gateway']:.3f}",
                     f"{added['thin'][0]:+.3f} / {added['thin'][1]:+.3f}",
                     f"{added['gateway'][0]:+.3f} / {added['gateway'][1]:+.3f}", "",
                     f"added p99 <= {TARGET_ADDED_P99_MS} ms" if goal else "", verdict(ok) if goal else ""])
        results[key] = {**{f"{n}_p50_ms": p50[n] for n in names}, **{f"{n}_p99_ms": p99[n] for n in names},
                        **{f"{n}_added_p50_ms": added[n][0] for n in added},
                        **{f"{n}_added_p99_ms": added[n][1] for n in added}, "n": len(values["gateway"]),
                        **({"pass": ok} if goal else {})}

    def rate_row(label: str, loads: dict[str, LoadResult], key: str, unit: str) -> None:
        ratio = loads["gateway"].rps / loads["thin"].rps if loads["thin"].rps else float("nan")
        ok = ratio >= TARGET_RATIO_TO_THIN
        rows.append([label, *(f"{loads[n].rps:,.0f} {unit}" for n in names), "", "", f"{ratio:.2f}x",
                     f">= {TARGET_RATIO_TO_THIN:.1f}x thin", verdict(ok)])
        results[key] = {"tool": loads["gateway"].tool, **{n: loads[n].__dict__ for n in names},
                        **{f"{n}_rps": loads[n].rps for n in names}, "ratio_to_thin": ratio, "pass": ok}

    latency_row("c=1 non-stream, p50 / p99 ms", {n: ms(c1[n].latency_ns) for n in names}, "c1", goal=True)
    rate_row(f"c={args.connections} non-stream", c64, "c64", "req/s")
    latency_row("s=1 first event, p50 / p99 ms", {n: ms(st[n].first_ns) for n in names}, "stream", goal=True)
    latency_row("s=1 whole stream, p50 / p99 ms", {n: ms(st[n].latency_ns) for n in names}, "stream_total",
                goal=False)
    rate_row(f"s={args.connections} streams", s64, "s64", "/s")
    # CPU per call (the target process, all its threads) hardly moves with background load: the figure to compare
    # between runs on a busy machine.
    for label, key, cpu in ((f"CPU per request, c={args.connections}", "cpu_per_request_us", cpu_us),
                            (f"CPU per stream, s={args.connections}", "cpu_per_stream_us", stream_cpu_us)):
        cpu_ratio = cpu["gateway"] / cpu["thin"] if cpu["thin"] else float("nan")
        cpu_ok = cpu_ratio < 1.0
        rows.append([label, "", f"{cpu['thin']:.0f} us", f"{cpu['gateway']:.0f} us", "", "", f"{cpu_ratio:.2f}x",
                     "< thin", verdict(cpu_ok)])
        results[key] = {**cpu, "ratio_to_thin": cpu_ratio, "pass": cpu_ok}

    header = ["scenario", "direct", "thin FastAPI+aiohttp", "trajgate", "thin added", "trajgate added",
              "trajgate/thin", "goal", ""]
    print()
    print(f"gateway overhead, capture on (Postgres), one run; c=1/s=1: raw-socket keep-alive client, "
          f"{len(c1['gateway'].latency_ns):,} requests/target, {len(st['gateway'].latency_ns):,} streams/target; "
          f"c={args.connections}/s={args.connections}: {c64['gateway'].tool}, {c64['gateway'].seconds:.1f} s/target")
    print("\n".join(text_table(header, rows)))
    failures = {name: dict(s.failed) for name, s in {**c1, **{f"stream {k}": v for k, v in st.items()}}.items()
                if s.failed}
    load_errors = {f"{kind} {n}": r.errors for kind, loads in (("c", c64), ("s", s64)) for n, r in loads.items()
                   if r.errors}
    if failures or load_errors:
        print(f"errors: c=1/s=1 {failures}; c/s={args.connections} {load_errors}")
    return results


if __name__ == "__main__":
    sys.exit(main())
