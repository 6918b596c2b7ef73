"""The gateway's threads carry their names into the OS, so `top -H`, `ps -L` and the benchmark's per-thread CPU
figures say which of them (writer, fsync, database pool) uses the time; Python 3.11 keeps names to itself. The writer
thread may also lower its own OS priority, and then shares its loop with a thread that did not (`Baton`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

log = logging.getLogger("trajgate.threads")

_PR_SET_NAME = 15
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def name_os_thread() -> None:
    """Give the calling thread's Python name (its first 15 bytes: the kernel's limit) to the OS thread."""
    name = threading.current_thread().name.encode()[:15]
    try:
        _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
    except AttributeError:  # not Linux: names stay Python's own
        pass


def lower_os_priority(nice: int, idle: bool = False) -> None:
    """Lower the calling thread's OS priority by `nice` (0-19), leaving the process's other threads as they are; with
    `idle` (and a `nice` above 0) also put it under the SCHED_IDLE policy.

    Linux schedules threads one by one and takes a thread id where setpriority(2) takes a process id, so only the
    caller is reniced. Elsewhere that id would name some process, so nothing is done. Unprivileged, a thread can lower
    its priority and never raise it again.

    Why SCHED_IDLE as well: Linux preempts a SCHED_IDLE task as soon as a task of a normal policy wakes on its core,
    where a nice-19 one may keep the core for the rest of its slice. On a 6.18 kernel the writer at nice 19 still cost
    the slowest 1 % of c=1 calls milliseconds, and SCHED_IDLE took c=1's added p99 from +1.3 to +0.8 ms
    (bench/README.md)."""
    if nice <= 0:
        return
    if sys.platform != "linux":
        name = threading.current_thread().name
        log.warning("a thread's own priority can be lowered only on Linux: %s keeps the gateway's", name)
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + nice)
        if idle:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: the calling thread
    except OSError as exc:
        log.warning("cannot lower the priority of %s: %s", threading.current_thread().name, exc)


class Baton:
    """Two threads taking turns at one loop, one turn at a time, so the loop keeps its order and its state as if one
    thread ran it: a thread of low OS priority runs it (`turn`) until the other, of normal priority, `claim`s it for as
    long as it needs; while the claim stands the first starts no turn. A thread cannot raise its priority again once
    lowered (unprivileged), so the loop moves between threads instead."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held = False
        self._claimed = False

    def turn(self) -> AbstractContextManager[None]:
        """One turn, once no turn is running and no claim stands."""
        return self._hold(claim=False)

    def claim(self) -> AbstractContextManager[None]:
        """Hold the loop from the end of the running turn until the block ends."""
        return self._hold(claim=True)

    @property
    def claimed(self) -> bool:
        """Whether the claiming thread holds the loop or waits for it."""
        return self._claimed

    @contextmanager
    def _hold(self, claim: bool) -> Iterator[None]:
        with self._cond:
            self._claimed = self._claimed or claim
            while self._held or (self._claimed and not claim):
                self._cond.wait()
            self._held = True
        try:
            yield
        finally:
            with self._cond:
                self._held = False
                self._claimed = self._claimed and not claim
                self._cond.notify_all()
