"""Which trajectory (and group, run, mode) a call belongs to.

Many agent frameworks let users set only `base_url` and `api_key` and silently drop custom headers, so three
forms are accepted and the first present wins: headers, a URL path prefix, then a suffix on the API key.
See docs/design.md §3. A call with none of them that carries a coding CLI's own session header (Claude Code's
`X-Claude-Code-Session-Id`, Codex's `session-id`) belongs to that session's trajectory, so one CLI run is one
trajectory (a group of one) that can be rewarded by the session id the CLI prints.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass

from gateway.http.errors import GatewayError
from gateway.runs.names import run_name_problem

# Not "." or "..": a path or a URL resolves those away, so such a trajectory could never be rewarded by its URL.
ID_RE = re.compile(r"^(?!\.\.?\Z)[A-Za-z0-9._:-]{1,128}\Z")  # (\Z: "$" would let a trailing newline in)
ID_RULE = "1-128 characters from [A-Za-z0-9._:-], not '.' or '..'"
MAX_GROUP_SIZE = 100_000
# Session ids the coding CLIs send on every call of a run, its sub-agents' calls included.
SESSION_HEADERS = ("x-claude-code-session-id", "session-id")

# /eval?/g/{group}(/n/{size})?/t/{trajectory}/v1/...  or  /eval?/t/{trajectory}/v1/...
PATH_RE = re.compile(
    r"^(?P<eval>/eval)?(?:/g/(?P<group>[^/]+)(?:/n/(?P<size>[^/]+))?)?/t/(?P<trajectory>[^/]+)(?P<rest>/v1(?:/.*)?)$"
)


class RandomIds:
    """128 fresh random bits as 32 hex digits per id, as unguessable as a uuid4's, from a buffer that one
    `os.urandom` refills every `per_fill` ids. A uuid4 per call is a getrandom system call on the event loop, and a
    system call releases the GIL: with the writer thread waiting for it, that handed the core away once per call."""

    def __init__(self, per_fill: int = 256) -> None:
        self._per_fill = per_fill
        self._lock = threading.Lock()
        self._hex = ""
        self._at = 0

    def __call__(self) -> str:
        with self._lock:
            if self._at >= len(self._hex):
                self._hex, self._at = os.urandom(16 * self._per_fill).hex(), 0
            at = self._at
            self._at = at + 32
            return self._hex[at : at + 32]


_fresh_id = RandomIds()


@dataclass(slots=True)
class Attribution:
    trajectory_id: str
    group_id: str
    group_size: int | None
    mode: str
    # True when the call carried no trajectory id and got a fresh one (a group of one, which never trains).
    generated: bool


@dataclass(slots=True)
class PathPrefix:
    """Attribution carried in the URL, and the OpenAI path that remains once it is taken off."""

    trajectory_id: str
    group_id: str | None
    group_size: str | None
    mode: str
    rest: str


def split_path(path: str) -> PathPrefix | None:
    match = PATH_RE.match(path)
    if match is None:
        return None
    return PathPrefix(
        trajectory_id=match["trajectory"],
        group_id=match["group"],
        group_size=match["size"],
        mode="eval" if match["eval"] else "train",
        rest=match["rest"],
    )


def split_api_key(raw: str | None) -> tuple[str | None, str | None, str | None]:
    """`<key>#<group>/<trajectory>` or `<key>#<trajectory>` -> (key, group, trajectory); ids never hold '#' or '/'."""
    if raw is None or "#" not in raw:
        return raw, None, None
    key, _, suffix = raw.rpartition("#")
    group, _, trajectory = suffix.rpartition("/")
    return key, group or None, trajectory or None


def check_id(value: str, what: str) -> str:
    if not ID_RE.match(value):
        raise GatewayError(
            400, f"invalid {what} {value[:160]!r}: use {ID_RULE}", code="invalid_id"
        )
    return value


def check_run(value: object) -> str:
    """The run a call names (`X-Run`, else `model`); the rule is gateway.runs.names', which the trainer shares."""
    problem = run_name_problem(value)
    if problem is not None:
        raise GatewayError(400, f"`model` must name a run: {problem}", code="invalid_model")
    assert isinstance(value, str)
    return value


def check_bound(run: str, runs: frozenset[str] | None) -> str:
    """`run` if the caller's key may use it: a key bound to runs (`Auth.check_agent`) gets any other run answered
    as OpenAI answers a model that does not exist, whether it exists or not, so a tenant learns nothing of the
    others' runs."""
    if runs is not None and run not in runs:
        message = f"The model `{run}` does not exist or you do not have access to it."
        raise GatewayError(404, message, code="model_not_found")
    return run


def _group_size(value: str | None) -> int | None:
    if value is None or value == "":
        return None
    try:
        size = int(value)
    except ValueError:
        size = 0
    if not 1 <= size <= MAX_GROUP_SIZE:
        raise GatewayError(400, f"invalid group size {value[:40]!r}: expected an integer >= 1", code="invalid_id")
    return size


def _mode(value: str | None, default: str) -> str:
    if value is None:
        return default
    mode = value.strip().lower()
    if mode not in ("train", "eval"):
        raise GatewayError(400, f"invalid X-Mode {value[:40]!r}: expected 'train' or 'eval'", code="invalid_mode")
    return mode


def attribute(
    headers: dict[str, str], prefix: PathPrefix | None, key_group: str | None, key_trajectory: str | None
) -> Attribution:
    """Resolve attribution from the three forms in priority order, validating whatever is used."""
    trajectory = headers.get("x-trajectory-id")
    group = size = None
    mode = "train"
    if trajectory is not None:
        group, size = headers.get("x-group-id"), headers.get("x-group-size")
    elif prefix is not None:
        trajectory, group, size, mode = prefix.trajectory_id, prefix.group_id, prefix.group_size, prefix.mode
    elif key_trajectory is not None:
        trajectory, group = key_trajectory, key_group
    else:
        # Not the client's attribution: a session id that is no valid trajectory id is passed over, never refused.
        trajectory = next((headers[h] for h in SESSION_HEADERS if ID_RE.match(headers.get(h) or "")), None)
    mode = _mode(headers.get("x-mode"), mode)
    if trajectory is None:
        fresh = "tg-" + _fresh_id()
        return Attribution(fresh, fresh, 1, mode, generated=True)
    check_id(trajectory, "trajectory id")
    if group is not None:
        check_id(group, "group id")
    if group is None:
        # A trajectory with no group is a group of one: recorded and rewardable, but never trained.
        return Attribution(trajectory, trajectory, _group_size(size) or 1, mode, generated=False)
    return Attribution(trajectory, group, _group_size(size), mode, generated=False)
