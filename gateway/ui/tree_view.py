"""The call tree of a trajectory (gateway.store.tree) laid out for the trajectory page's inline SVG.

One row per call in the order they were made, so time reads downwards as in the call list below it; one lane per
branch (a root, or a fork: a call that continues a parent whose branch goes on in another call), a lane reused once
the branch it held has ended. An edge runs from each call to its tree parent; a root says why it extends nothing
(first call, new_root, compacted, ...). Laid out on the server: the page needs no script for it, and a test can
count nodes and edges in the HTML.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ROW_H = 24
LANE_W = 18
PAD = 12
RADIUS = 5
LABEL_GAP = 10
LABEL_W = 420


@dataclass(slots=True)
class TreeNode:
    x: float
    y: float
    kind: str  # "root" | "extends" | "fork"
    href: str
    label: str
    reason: str | None  # a root's break reason
    trainable: bool


@dataclass(slots=True)
class TreeLayout:
    width: int
    height: int
    label_x: float
    nodes: list[TreeNode] = field(default_factory=list)
    edges: list[str] = field(default_factory=list)  # SVG path data, one per call with a parent


def _describe(call: dict[str, Any]) -> tuple[str, str, str | None]:
    """(kind, what the label says about the call's place, the break reason for a root)."""
    if call["parent"] is None:
        reason = call.get("merge_reason") or "no reason recorded"
        return "root", "first call" if reason == "first_call" else f"new root: {reason}", reason
    where = f"turn {call['parent_turn']}" + (f" choice {call['parent_choice']}" if call["parent_choice"] else "")
    if call["fork"]:
        return "fork", f"fork of {where}", None
    return "extends", f"extends {where}", None


def layout(calls: list[dict[str, Any]]) -> TreeLayout:
    """Positions for `calls` (as gateway.store.ui_reads.trajectory_page returns them: each with seq, choice_index,
    turn, parent, branch, parent_turn, parent_choice, fork, merge_reason, trainable)."""
    row_of = {(c["seq"], c["choice_index"]): row for row, c in enumerate(calls)}
    spans: dict[int, list[int]] = {}  # branch -> [first row it occupies, last row]
    for row, call in enumerate(calls):
        parent = call["parent"]
        start = row_of.get((parent["seq"], parent["choice_index"]), row) if parent else row
        span = spans.setdefault(call["branch"], [start, row])
        span[0], span[1] = min(span[0], start), max(span[1], row)
    lane_of: dict[int, int] = {}
    lane_ends: list[int] = []
    for branch, (start, end) in sorted(spans.items(), key=lambda item: (item[1][0], item[0])):
        free = next((lane for lane, last in enumerate(lane_ends) if last < start), None)
        if free is None:
            free = len(lane_ends)
            lane_ends.append(end)
        lane_ends[free] = end
        lane_of[branch] = free
    lanes = max(len(lane_ends), 1)
    label_x = PAD + lanes * LANE_W + LABEL_GAP

    def point(row: int, branch: int) -> tuple[float, float]:
        return PAD + lane_of[branch] * LANE_W + RADIUS, PAD + row * ROW_H + RADIUS

    out = TreeLayout(width=int(label_x + LABEL_W), height=int(2 * PAD + max(len(calls) - 1, 0) * ROW_H + 2 * RADIUS),
                     label_x=label_x)  # fmt: skip
    for row, call in enumerate(calls):
        x, y = point(row, call["branch"])
        kind, place, reason = _describe(call)
        choice = f" choice {call['choice_index']}" if call["choice_index"] else ""
        out.nodes.append(TreeNode(x, y, kind, f"#turn-{call['turn']}-{call['choice_index']}",
                                  f"turn {call['turn']}{choice} · {place}", reason, bool(call["trainable"])))  # fmt: skip
        parent = call["parent"]
        if parent is None:
            continue
        parent_row = row_of.get((parent["seq"], parent["choice_index"]))
        if parent_row is None:  # a parent outside the trajectory's calls: nothing to draw to
            continue
        px, py = point(parent_row, calls[parent_row]["branch"])
        if px == x:
            out.edges.append(f"M{px:g},{py:g} L{x:g},{y:g}")
        else:  # leave the parent sideways into the child's lane, then down to the child
            bend = py + ROW_H
            out.edges.append(f"M{px:g},{py:g} C{px:g},{py + ROW_H / 2:g} {x:g},{py:g} {x:g},{bend:g} L{x:g},{y:g}")
    return out
