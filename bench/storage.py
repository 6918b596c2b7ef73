"""Stored bytes per trajectory as a conversation grows, whole calls (the layout before revisions 0004/0005) against
linear storage (each call stores only the prompt ids and the request messages past what it shares with its
predecessor), measured on the real store: SQLite and Postgres.

A synthetic N-turn tool conversation (~470 tokens a turn, ~30k tokens at 64 turns; every other turn the assistant
calls a tool and the next turn sends its result) is written straight into the store, one call per batch as the writer
does at low traffic, not through the gateway: the fake upstream replays recorded answers, so its ids do not extend
from turn to turn the way a real model's do. Message text is random words (compressible like prose, not like a run of
one letter), and every request carries the same two tool schemas, as agents send them.

"Before" writes the very same calls each as the first call of a trajectory of its own, so nothing is shared and every
row holds its whole prompt and whole request, exactly what a row held before 0004; "after" writes them as one
trajectory. Columns: ids = prompt + completion ids and logprobs (bytes), request and response = JSON text length,
total = the three; on Postgres also the on-disk size of those columns after TOAST compression (`pg_column_size`).

Shapes (`--shapes`): the same store, one trajectory per shape of tests/support/trajectory_shapes.py (linear, supervisor with a
sub-agent every 8th call, two alternating forks, compaction every 8 calls; ~470 ids a call) at 16/32/64 calls:
bytes of stored prompt ids, all stored ids (prompt + completion) over the trajectory's distinct ids, and request JSON
bytes. A trajectory of any shape should store about its distinct ids, growing linearly with its calls.

Run: `python bench/storage.py [--turns 1 8 16 32 64] [--shapes 16 32 64] [--pg-url URL | --no-pg]` (without --pg-url
it starts a throwaway Postgres with tests.support.pgcluster, as the tests do).
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from sqlalchemy import Engine, Text, cast, func, select  # noqa: E402

from gateway.store import db  # noqa: E402
from gateway.store.call_record import CallRecord  # noqa: E402
from gateway.store.models import Call  # noqa: E402
from gateway.store.records import LineageCache, write_calls  # noqa: E402
from tests.support.trajectory_shapes import SHAPES, shaped  # noqa: E402

USER_TOKENS = 300
COMPLETION_TOKENS = 160
GLUE = [1, 4093, 198]  # "<|im_start|>user\n"-like template tokens between turns
WORDS = [f"{a}{b}" for a in ("ka", "lo", "mi", "ner", "pu", "sa", "ti", "vo") for b in ("ba", "den", "go", "ro", "sh")]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name.replace('_', ' ')} for the user's question; returns JSON.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "description": "what to look up"}},
                "required": ["query"],
            },
        },
    }
    for name in ("search_documents", "get_weather")
]


def _text(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


def conversation(turns: int, seed: int) -> list[CallRecord]:
    """Calls of one trajectory whose prompts each extend the previous prompt + completion, and whose messages each
    extend the previous request's messages by the assistant's answer and the next user message or tool result."""
    rng = random.Random(seed)
    trajectory_id = uuid.uuid4().hex
    history: list[int] = [1, 9690, 198]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant with tools."}]
    records = []
    answer: dict[str, Any] | None = None
    for turn in range(turns):
        if answer is not None and answer.get("tool_calls"):
            new = {"role": "tool", "tool_call_id": answer["tool_calls"][0]["id"], "content": _text(rng, USER_TOKENS)}
        else:
            new = {"role": "user", "content": _text(rng, USER_TOKENS)}
        messages = [*messages, new]
        prompt = history + GLUE + [rng.randrange(10, 49_000) for _ in range(USER_TOKENS)] + [2, 198, 1, 520, 9531, 198]
        completion = [rng.randrange(10, 49_000) for _ in range(COMPLETION_TOKENS - 1)] + [2]
        if turn % 2 == 0:
            call = {"name": "search_documents", "arguments": '{"query": "' + _text(rng, 20) + '"}'}
            answer = {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": f"call_{turn}", "type": "function", "function": call}],
            }
        else:
            answer = {"role": "assistant", "content": _text(rng, COMPLETION_TOKENS)}
        records.append(
            CallRecord(
                id=uuid.uuid4().hex,
                run="bench",
                base_model="smollm2",
                trajectory_id=trajectory_id,
                group_id=f"g-{trajectory_id}",
                group_size=1,
                mode="train",
                seq=turn + 1,
                choice_index=0,
                policy_version=0,
                endpoint="chat",
                stream=False,
                request={"model": "bench", "messages": messages, "tools": TOOLS, "max_tokens": COMPLETION_TOKENS},
                response={
                    "id": f"chatcmpl-{turn}",
                    "object": "chat.completion",
                    "model": "smollm2",
                    "choices": [
                        {
                            "index": 0,
                            "message": answer,
                            "finish_reason": "tool_calls" if answer.get("tool_calls") else "stop",
                        }
                    ],
                    "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(completion)},
                },
                prompt_token_ids=prompt,
                completion_token_ids=completion,
                completion_logprobs=[-rng.random() for _ in completion],
                finish_reason="stop",
                usage={"prompt_tokens": len(prompt), "completion_tokens": len(completion)},
                status_code=200,
                error=None,
                trainable=True,
                untrainable_reason=None,
                latency_ms=10.0,
                ttft_ms=None,
                retry_count=0,
                idempotency_key=None,
                created_at=time.time() + turn * 1e-3,
            )
        )
        messages = [*messages, answer]
        history = prompt + completion
    return records


def _each_its_own(records: list[CallRecord]) -> list[CallRecord]:
    """The same calls as first calls of trajectories of their own: every row holds its whole prompt and request."""
    alone = []
    for record in records:
        copied = copy.copy(record)
        copied.id = uuid.uuid4().hex
        copied.trajectory_id = copied.group_id = f"alone-{copied.id}"
        alone.append(copied)
    return alone


def _stored_bytes(engine: Engine, trajectory_ids: list[str]) -> dict[str, float]:
    ids = (
        func.length(Call.prompt_token_ids) + func.length(Call.completion_token_ids) + func.length(Call.completion_logprobs)
    )
    columns = [
        func.count(),
        func.sum(ids),
        func.sum(func.length(cast(Call.request, Text))),
        func.sum(func.length(cast(Call.response, Text))),
    ]
    if engine.dialect.name == "postgresql":
        on_disk = [
            func.pg_column_size(c)
            for c in (Call.prompt_token_ids, Call.completion_token_ids, Call.completion_logprobs, Call.request, Call.response)
        ]
        columns.append(func.sum(on_disk[0] + on_disk[1] + on_disk[2] + on_disk[3] + on_disk[4]))
    with engine.connect() as conn:
        row = conn.execute(select(*columns).where(Call.trajectory_id.in_(trajectory_ids))).one()
    out = {
        "rows": row[0],
        "ids": row[1],
        "request": row[2],
        "response": row[3],
    }
    out["total"] = out["ids"] + out["request"] + out["response"]
    out["disk"] = row[4] if len(row) > 4 else None
    return out


def measure(engine: Engine, turns: int) -> dict[str, Any]:
    records = conversation(turns, seed=turns)
    alone = _each_its_own(records)
    cache = LineageCache()  # the writer's
    started = time.perf_counter()
    for record in records:
        write_calls(engine, [record], cache)
    write_ms = (time.perf_counter() - started) * 1000 / turns
    for record in alone:
        write_calls(engine, [record], cache)
    final_tokens = len(records[-1].prompt_token_ids or []) + len(records[-1].completion_token_ids or [])
    return {
        "turns": turns,
        "final_tokens": final_tokens,
        "before": _stored_bytes(engine, [r.trajectory_id for r in alone]),
        "after": _stored_bytes(engine, [records[0].trajectory_id]),
        "write_ms": write_ms,
    }


@contextmanager
def _postgres(url: str | None) -> Iterator[str]:
    if url is not None:
        yield url
        return
    from tests.support.pgcluster import PgCluster, create_database

    cluster = PgCluster()
    cluster.start()
    try:
        yield create_database(cluster.url())
    finally:
        cluster.destroy()


def _report(name: str, results: list[dict[str, Any]]) -> None:
    print(f"\n{name}: KB stored per trajectory, before (whole calls) / after (linear), and before/after")
    parts = ["ids", "request", "response", "total"] + (["disk"] if results[0]["after"]["disk"] is not None else [])
    header = f"{'turns':>5} {'final tok':>9} " + " ".join(f"{p + ' before':>14} {'after':>8} {'x':>5}" for p in parts)
    print(header + f" {'write ms/call':>13}")
    for r in results:
        cells = []
        for part in parts:
            before, after = r["before"][part], r["after"][part]
            cells.append(f"{before / 1024:>14.1f} {after / 1024:>8.1f} {before / after:>5.1f}")
        print(f"{r['turns']:>5} {r['final_tokens']:>9} " + " ".join(cells) + f" {r['write_ms']:>13.2f}")
    print("growth per doubling of turns (total bytes, before -> after):")
    for small, big in zip(results, results[1:]):
        if big["turns"] == 2 * small["turns"]:
            print(
                f"  {small['turns']:>2} -> {big['turns']:>2}: x{big['before']['total'] / small['before']['total']:.2f}"
                f" -> x{big['after']['total'] / small['after']['total']:.2f}"
            )


def _run(url: str, turns: list[int]) -> list[dict[str, Any]]:
    db.upgrade(url)
    engine = db.make_engine(url)
    try:
        return [measure(engine, n) for n in turns]
    finally:
        engine.dispose()


def measure_shapes(url: str, turns: list[int]) -> list[dict[str, Any]]:
    """Per shape and length: stored prompt-id bytes, stored ids over distinct ids, request bytes."""
    db.upgrade(url)
    engine = db.make_engine(url)
    results = []
    try:
        for shape in SHAPES:
            for n in turns:
                trajectory = shaped(shape, n, seed=n, new_tokens=USER_TOKENS + 6, completion_tokens=COMPLETION_TOKENS)
                cache = LineageCache()  # the writer's
                for record in trajectory.records:
                    write_calls(engine, [record], cache)
                with engine.connect() as conn:
                    prompt, completion, request = conn.execute(
                        select(
                            func.sum(func.length(Call.prompt_token_ids)),
                            func.sum(func.length(Call.completion_token_ids)),
                            func.sum(func.length(cast(Call.request, Text))),
                        ).where(Call.trajectory_id == trajectory.records[0].trajectory_id)
                    ).one()
                results.append(
                    {"shape": shape, "turns": n, "prompt_bytes": prompt, "ratio": (prompt + completion) / 4 /
                     trajectory.distinct, "request_bytes": request}
                )  # fmt: skip
    finally:
        engine.dispose()
    return results


def _report_shapes(name: str, results: list[dict[str, Any]]) -> None:
    print(f"\n{name}: per shape, bytes of stored prompt ids, stored ids / distinct ids, request bytes")
    print(f"{'shape':>11} {'calls':>5} {'prompt ids B':>13} {'ids/distinct':>12} {'request B':>10}")
    for r in results:
        print(f"{r['shape']:>11} {r['turns']:>5} {r['prompt_bytes']:>13,} {r['ratio']:>12.2f} {r['request_bytes']:>10,}")
    for shape in SHAPES:
        rows = [r for r in results if r["shape"] == shape]
        if len(rows) > 1:
            print(f"  {shape}: prompt ids x{rows[-1]['prompt_bytes'] / rows[0]['prompt_bytes']:.2f} for "
                  f"x{rows[-1]['turns'] / rows[0]['turns']:.0f} the calls")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    parser.add_argument("--pg-url", help="an empty Postgres database (default: start a throwaway cluster)")
    parser.add_argument("--shapes", type=int, nargs="*", default=[16, 32, 64], help="calls per shape (none: skip)")
    parser.add_argument("--no-pg", action="store_true", help="SQLite only")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        _report("SQLite", _run(f"sqlite:///{Path(tmp) / 'storage.db'}", args.turns))
        if args.shapes:
            _report_shapes("SQLite", measure_shapes(f"sqlite:///{Path(tmp) / 'shapes.db'}", args.shapes))
    if not args.no_pg:
        with _postgres(args.pg_url) as url:
            _report("Postgres", _run(url, args.turns))
            if args.shapes:
                _report_shapes("Postgres", measure_shapes(url, args.shapes))


if __name__ == "__main__":
    main()
