"""The gateway's threads carry their names into the OS, so `top -H`, `ps -L` and the benchmark's per-thread CPU
figures say which of them (writer, fsync, database pool) uses the time; Python 3.11 keeps names to itself. The writer
thread may also lower its own OS priority."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import threading

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


def lower_os_priority(nice: int) -> None:
    """Lower the calling thread's OS priority by `nice` (0-19), leaving the process's other threads as they are.

    Linux schedules threads one by one and takes a thread id where setpriority(2) takes a process id, so only the
    caller is reniced. Elsewhere that id would name some process, so nothing is done. Unprivileged, a thread can lower
    its priority and never raise it again."""
    if nice <= 0:
        return
    if sys.platform != "linux":
        name = threading.current_thread().name
        log.warning("a thread's own priority can be lowered only on Linux: %s keeps the gateway's", name)
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + nice)
    except OSError as exc:
        log.warning("cannot lower the priority of %s: %s", threading.current_thread().name, exc)
