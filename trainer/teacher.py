"""The teacher of on-policy distillation (loss ``distill``, docs/objectives.md §10): the logprob a vLLM-served teacher
gives each token of the student's recorded rows, and where those logprobs are kept so a retried step reuses them.

The teacher scores exactly the ids the student produced, as vLLM ``prompt_logprobs``: one ``/v1/completions`` request
per batch of rows with ``prompt`` = the rows' token id lists (no chat template, no re-tokenisation), ``temperature``
0 and ``max_tokens`` 1 (vLLM refuses 0: tests/fixtures/vllm/error_teacher_max_tokens_0.json). ``prompt_logprobs: 0``
returns, at every position but the first, the logprob of the token actually there (plus nothing else), which is the
layout ``trainer.samples.Row`` uses: position ``t`` scored given ``ids[:t]``. The teacher must therefore share the
student's tokenizer (a bigger model of the same family, or an adapter of the same base).

Never partial: an answer missing a position, for another sequence, or with a non-finite logprob is an error and no
logprob of that batch is used. An unreachable teacher (connection refused, timeout, 5xx, 404 while an adapter loads,
429) makes the step wait, with backoff, saying so; it never trains without the teacher's logprobs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

log = logging.getLogger("trajgate.trainer")

# Statuses that mean "not now" rather than "never": the step waits for them.
_TRANSIENT = {404, 408, 429, 500, 502, 503, 504}


class TeacherAnswerError(ValueError):
    """The teacher answered something the step cannot use (a position missing, another sequence, a non-finite
    logprob, a 4xx such as a row longer than its context): training on it would be training on missing logprobs."""


def request_body(model: str, sequences: Sequence[Sequence[int]]) -> dict[str, Any]:
    """The ``/v1/completions`` body that scores ``sequences`` (token id lists) under ``model``, sampling nothing that
    matters: the one generated token is ignored."""
    return {
        "model": model,
        "prompt": [list(ids) for ids in sequences],
        "max_tokens": 1,
        "temperature": 0,
        "prompt_logprobs": 0,
        # vLLM echoes the ids it scored: parse_prompt_logprobs checks they are the ones sent
        "return_token_ids": True,
    }


def parse_prompt_logprobs(answer: dict[str, Any], sequences: Sequence[Sequence[int]]) -> list[list[float]]:
    """Each sequence's teacher logprobs, aligned to its ids (position 0, which nothing predicts, is 0.0).

    ``answer`` is vLLM's JSON for ``request_body(model, sequences)``: one choice per prompt (``index`` = the prompt's
    position), ``prompt_logprobs`` a list as long as the prompt, ``null`` first, then at each position a dict keyed
    by token id (as a string) holding at least the token at that position. Raises TeacherAnswerError on anything
    else, for the whole batch.
    """
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != len(sequences):
        got = len(choices) if isinstance(choices, list) else "no"
        raise TeacherAnswerError(f"the teacher answered {got} choices for {len(sequences)} sequences")
    by_index: dict[int, dict[str, Any]] = {}
    for choice in choices:
        index = choice.get("index") if isinstance(choice, dict) else None
        if not isinstance(index, int) or not 0 <= index < len(sequences) or index in by_index:
            raise TeacherAnswerError(f"the teacher answered a choice with index {index!r}")
        by_index[index] = choice
    out = []
    for index, ids in enumerate(sequences):
        choice = by_index[index]
        echoed = choice.get("prompt_token_ids")
        if echoed is not None and list(echoed) != list(ids):
            raise TeacherAnswerError(f"sequence {index}: the teacher scored other ids than those sent")
        positions = choice.get("prompt_logprobs")
        if not isinstance(positions, list) or len(positions) != len(ids):
            got = len(positions) if isinstance(positions, list) else "no"
            raise TeacherAnswerError(
                f"sequence {index}: {got} prompt_logprobs for {len(ids)} tokens (is prompt_logprobs enabled?)"
            )
        logprobs = [0.0]
        for t in range(1, len(ids)):
            entry = positions[t].get(str(ids[t])) if isinstance(positions[t], dict) else None
            value = entry.get("logprob") if isinstance(entry, dict) else None
            if not isinstance(value, int | float) or not math.isfinite(value):
                raise TeacherAnswerError(f"sequence {index}: no finite teacher logprob for token {ids[t]} at {t}")
            logprobs.append(float(value))
        out.append(logprobs)
    return out


@dataclass
class Teacher:
    """A vLLM that serves the teacher ``model`` at ``base_url`` (``…/v1``).

    ``batch_size`` rows go in one request. The default is 1 because vLLM 0.32 on CPU with ``--enable-lora`` (how
    trajgate serves a run) kills its engine whenever a prompt_logprobs request shares an engine step with another
    request (an einsum batch mismatch in the CPU LoRA logits op): several rows in one request, or a teacher request
    beside an agent's call. Measured: one row per request, on a vLLM serving nothing else, works.
    ``backoff_s`` doubles up to ``max_backoff_s`` between tries while the teacher is unreachable; ``max_wait_s`` None
    waits until ``stop`` is set (or for ever).
    """

    model: str
    base_url: str
    api_key: str | None = None
    timeout_s: float = 300.0
    batch_size: int = 1
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    max_wait_s: float | None = None

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(
            self.base_url.rstrip("/") + "/completions", data=json.dumps(body).encode(), headers=headers, method="POST"
        )
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            answer = json.loads(response.read())
        if not isinstance(answer, dict):
            raise TeacherAnswerError("the teacher's answer is not a JSON object")
        return answer

    def _score_batch(
        self, sequences: Sequence[Sequence[int]], stop: threading.Event | None, echo: Callable[[str], None]
    ) -> list[list[float]]:
        body = request_body(self.model, sequences)
        delay, waited = self.backoff_s, 0.0
        while True:
            try:
                return parse_prompt_logprobs(self._post(body), sequences)
            except urllib.error.HTTPError as error:
                detail = error.read().decode(errors="replace")[:500]
                if error.code not in _TRANSIENT:
                    raise TeacherAnswerError(
                        f"the teacher {self.model!r} refused the request ({error.code}): {detail}"
                    ) from None
                why = f"HTTP {error.code}: {detail}"
            except (urllib.error.URLError, TimeoutError, ConnectionError) as error:
                why = f"{type(error).__name__}: {getattr(error, 'reason', error)}"
            if self.max_wait_s is not None and waited >= self.max_wait_s:
                raise TimeoutError(f"the teacher {self.model!r} at {self.base_url} is still unreachable ({why})")
            message = (
                f"teacher {self.model!r} at {self.base_url} unreachable ({why}); the step waits, retrying in {delay:g}s"
            )
            log.warning(message)
            echo(message)
            if stop is not None and stop.wait(delay):
                raise InterruptedError("stopped while waiting for the teacher")
            if stop is None:
                time.sleep(delay)
            waited += delay
            delay = min(delay * 2, self.max_backoff_s)

    def score(
        self,
        sequences: Sequence[Sequence[int]],
        *,
        stop: threading.Event | None = None,
        echo: Callable[[str], None] = lambda _: None,
    ) -> list[list[float]]:
        """The teacher's logprobs of every sequence, aligned to its ids (``parse_prompt_logprobs``); waits while the
        teacher is unreachable, and raises rather than return anything partial."""
        out: list[list[float]] = []
        for start in range(0, len(sequences), self.batch_size):
            out += self._score_batch(sequences[start : start + self.batch_size], stop, echo)
        return out


def row_key(teacher: str, ids: Sequence[int]) -> str:
    """What identifies a row's teacher logprobs: the teacher's name and the row's exact ids (a retried step with the
    same rows reuses them; another teacher, or other tokens, never does)."""
    digest = hashlib.sha256(teacher.encode())
    digest.update(b"\0")
    digest.update(torch.tensor(list(ids), dtype=torch.int64).numpy().tobytes())
    return digest.hexdigest()


class TeacherStore:
    """The teacher logprobs of each step, one safetensors file per step under the run's checkpoint directory
    (``teacher/step-NNNNNNNN.safetensors``, a float32 tensor per row keyed by ``row_key``).

    Not inside the step's checkpoint directory: that one is written after the update and discarded when the step is
    not committed, which is exactly when a retried step needs the logprobs again. A retry of step ``n`` (after a
    crash, a lost commit, a failed update) reads this file and asks the teacher only for rows it does not hold, so
    the rows it trained before are trained against the same teacher logprobs; the file is written (atomically)
    before the update. Files of committed steps stay as the record of what each step distilled from.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, step: int) -> Path:
        return self.directory / f"step-{step:08d}.safetensors"

    def load(self, step: int) -> dict[str, torch.Tensor]:
        path = self.path(step)
        return load_file(str(path)) if path.exists() else {}

    def save(self, step: int, logprobs: dict[str, torch.Tensor]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.path(step).with_suffix(f".tmp-{os.getpid()}")
        save_file({key: value.contiguous() for key, value in logprobs.items()}, str(tmp))
        os.replace(tmp, self.path(step))


def teacher_logprobs_for_step(
    teacher: Teacher,
    store: TeacherStore,
    step: int,
    sequences: Sequence[Sequence[int]],
    *,
    stop: threading.Event | None = None,
    echo: Callable[[str], None] = lambda _: None,
) -> list[list[float]]:
    """The teacher logprobs of every sequence of step ``step``, aligned to its ids: those the store holds for this
    step as stored, the others from the teacher (then stored, before anything trains on them)."""
    held = store.load(step)
    keys = [row_key(teacher.model, ids) for ids in sequences]
    missing_unique = list({key: i for i, key in enumerate(keys) if key not in held}.values())  # one per distinct row
    if missing_unique:
        scored = teacher.score([sequences[i] for i in missing_unique], stop=stop, echo=echo)
        for i, fresh in zip(missing_unique, scored, strict=True):
            held[keys[i]] = torch.tensor(fresh, dtype=torch.float32)
        store.save(step, held)
    out = []
    for key, ids in zip(keys, sequences, strict=True):
        values = held[key]
        if values.numel() != len(ids):  # a file written by something else: never train on it
            raise TeacherAnswerError(f"stored teacher logprobs of step {step} do not match a row's length")
        out.append(values.tolist())
    return out
