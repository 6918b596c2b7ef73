"""The gateway's threads carry their names into the OS, so `top -H`, `ps -L` and the benchmark's per-thread CPU
figures say which of them (writer, fsync, database pool) uses the time; Python 3.11 keeps names to itself."""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

_PR_SET_NAME = 15
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def name_os_thread() -> None:
    """Give the calling thread's Python name (its first 15 bytes: the kernel's limit) to the OS thread."""
    name = threading.current_thread().name.encode()[:15]
    try:
        _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
    except AttributeError:  # not Linux: names stay Python's own
        pass
