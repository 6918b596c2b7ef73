"""The one rule for run names, shared by the gateway (a call's `model` / `X-Run`, `POST /v1/runs`) and the trainer's
checkpoint store, so a run the gateway accepts is always one the trainer can train.

Agents name the run in `model`, where hub-style names such as `org/model-name` are common, so '/' is allowed
between non-empty parts; a part may not be `.` or `..`, which URLs and file systems would resolve away.
"""

from __future__ import annotations

import functools
import re

_CHARS_RE = re.compile(r"^[A-Za-z0-9._:/-]{1,128}$")
RULE = "1-128 characters from [A-Za-z0-9._:/-], '/' only between parts, no part '.' or '..'"


def run_name_problem(name: object) -> str | None:
    """Why `name` cannot be a run's name, or None if it can. Every model call asks, mostly about the same few names."""
    if not isinstance(name, str) or len(name) > 128:  # (never cache a long string a client sent)
        return f"use {RULE}"
    return _string_problem(name)


@functools.lru_cache(maxsize=4096)
def _string_problem(name: str) -> str | None:
    if not _CHARS_RE.match(name):
        return f"use {RULE}"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return f"use {RULE}"
    return None


def check_run_name(name: str) -> str:
    """`name` if it is a valid run name; ValueError (starting 'run name') otherwise."""
    problem = run_name_problem(name)
    if problem is not None:
        raise ValueError(f"run name {str(name)[:160]!r} is not valid: {problem}")
    return name
