"""A throwaway Postgres cluster for tests and benchmarks.

initdb/pg_ctl refuse to run as root, so when we are root they run as the `postgres` user on a data
directory it owns. Tests that stop the database on purpose (spool, replay) need a cluster of their own,
which is why this is a class and not just a URL.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

from trainer.demo.vllm_cpu import free_port  # noqa: F401  (tests take it from here, with the cluster helpers)


def _bindir() -> Path:
    for tool in ("pg_config",):
        found = shutil.which(tool)
        if found:
            out = subprocess.run([found, "--bindir"], capture_output=True, text=True).stdout.strip()
            if out and Path(out, "initdb").exists():
                return Path(out)
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), reverse=True)
    if candidates:
        return Path(candidates[0]).parent
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    raise RuntimeError("Postgres binaries not found: install postgresql (apt-get install -y postgresql)")


class PgCluster:
    """initdb + pg_ctl on a temp dir and a free port; trust auth on 127.0.0.1 only."""

    def __init__(self) -> None:
        self.bindir = _bindir()
        self.root = Path(tempfile.mkdtemp(prefix="trajgate-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self._as_root = os.geteuid() == 0
        if self._as_root:
            shutil.chown(self.root, "postgres", "postgres")
        self._run(["initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"])

    def _run(self, argv: list[str]) -> None:
        cmd = [str(self.bindir / argv[0]), *argv[1:]]
        if self._as_root:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed ({result.returncode}): {result.stderr.strip() or result.stdout}")

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        self._run(["pg_ctl", "-D", str(self.data), "-l", str(self.root / "log"), "-o", options, "-w", "start"])

    def stop(self, mode: str = "fast") -> None:
        self._run(["pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop"])

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def destroy(self) -> None:
        try:
            self.stop("immediate")
        except RuntimeError:
            pass
        shutil.rmtree(self.root, ignore_errors=True)


def create_database(server_url: str) -> str:
    """A fresh, uniquely named database on the server; returns its URL."""
    import psycopg

    name = "t_" + uuid.uuid4().hex[:12]
    plain = server_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(plain, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base, _, _ = server_url.rpartition("/")
    return f"{base}/{name}"


def drop_database(url: str) -> None:
    import psycopg

    base, _, name = url.rpartition("/")
    plain = f"{base}/postgres".replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(plain, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
