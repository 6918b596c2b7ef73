"""Reading the judge's answer: liberal in the shapes it accepts, strict about what it stores.

Accepted: the JSON object alone, inside a ```json fence or surrounded by prose; `scores` as a list of
`{"trajectory_id"|"id", "score"|"reward", "explanation"|"reason"}` or as a map from id to a score or to such an
object; a score written as a numeric string. Refused (InvalidAnswer, so the judge is asked again): no JSON, an id
missing, unknown or given twice, a score that is not a finite number in [0, 1].
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gateway.judge.prompt import EXPLANATION_MAX_CHARS

_FENCE = re.compile(r"```(?:json|JSON)?\s*(.*?)```", re.DOTALL)


class InvalidAnswer(ValueError):
    """The answer cannot be used; the message says why in words the judge model can act on."""


@dataclass(frozen=True, slots=True)
class Score:
    trajectory_id: str
    score: float
    explanation: str


def _json_candidates(text: str) -> list[Any]:
    """Every JSON value that plausibly is the answer, best first."""
    found: list[Any] = []
    stripped = text.strip()
    for candidate in [stripped, *(m.group(1).strip() for m in _FENCE.finditer(text))]:
        try:
            found.append(json.loads(candidate))
        except ValueError:
            pass
    decoder = json.JSONDecoder()
    for start in [m.start() for m in re.finditer(r"[{\[]", text)][:50]:
        try:
            value, _ = decoder.raw_decode(text, start)
        except ValueError:
            continue
        found.append(value)
    return found


def _entries(value: Any) -> list[tuple[Any, Any, Any]] | None:
    """(id, score, explanation) triples from one of the accepted shapes, or None if the shape is not one."""
    scores = value.get("scores", value.get("results")) if isinstance(value, dict) else value
    if isinstance(scores, list):
        out = []
        for item in scores:
            if not isinstance(item, dict):
                return None
            tid = item.get("trajectory_id", item.get("id"))
            score = item.get("score", item.get("reward"))
            out.append((tid, score, item.get("explanation", item.get("reason"))))
        return out
    if isinstance(scores, dict) and scores:
        out = []
        for tid, item in scores.items():
            if isinstance(item, dict):
                out.append((tid, item.get("score", item.get("reward")), item.get("explanation", item.get("reason"))))
            else:
                out.append((tid, item, None))
        return out
    return None


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


def one_line(text: Any, limit: int = EXPLANATION_MAX_CHARS) -> str:
    line = " ".join(str(text or "").split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def parse_scores(text: str | None, ids: Sequence[str]) -> list[Score]:
    """The judge's scores in the order of `ids`; raises InvalidAnswer saying everything that is wrong."""
    if not text or not text.strip():
        raise InvalidAnswer("the answer was empty")
    shaped = [e for e in (_entries(v) for v in _json_candidates(text)) if e is not None]
    if not shaped:
        raise InvalidAnswer('the answer is not a JSON object of the form {"scores": [...]}')
    entries = max(shaped, key=lambda e: sum(1 for tid, _, _ in e if tid in ids))  # the most complete candidate
    wanted = set(ids)
    problems: list[str] = []
    got: dict[str, Score] = {}
    for tid, raw_score, explanation in entries:
        if not isinstance(tid, str) or tid not in wanted:
            problems.append(f"unknown trajectory id {tid!r}")
            continue
        if tid in got:
            problems.append(f"trajectory {tid!r} is scored more than once")
            continue
        score = _number(raw_score)
        if score is None or not math.isfinite(score):
            problems.append(f"the score of {tid!r} is not a number: {raw_score!r}")
            continue
        if not 0.0 <= score <= 1.0:
            problems.append(f"the score of {tid!r} is {score!r}, outside [0, 1]")
            continue
        got[tid] = Score(tid, score, one_line(explanation))
    missing = [tid for tid in ids if tid not in got and not any(p for p in problems if repr(tid) in p)]
    if missing:
        problems.append("no score for " + ", ".join(repr(tid) for tid in missing))
    if problems:
        raise InvalidAnswer("; ".join(problems))
    return [got[tid] for tid in ids]
