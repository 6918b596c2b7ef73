"""What finding each call's tree parent (gateway.store.tree) adds to recording it, at 64 turns.

The lookup runs in the writer's transaction, off the response path (a client never waits on it), so its cost shows
as writer time per call. A synthetic agent trajectory of `--turns` turns (each turn adds `--turn-tokens` prompt ids
and answers `--completion-tokens`; the ids are random, the shape is an agent's: every prompt extends the previous
call, and a sub-agent root every `--sub-every` turns, so the trajectory's candidates are a tree) is written one call
per batch, the way the writer writes under light traffic, twice on fresh databases: with the tree lookup, and with
it switched off (no parent lookup, no tree keys hashed or stored). Printed per backend: median ms per call over the
last 8 turns and over all turns, both ways, and the difference; then the lookup alone (`find_parent` over the
trajectory's candidates, µs per call at the last turn) and the work it counted.

Run: `python bench/call_tree.py [--turns 64] [--url postgresql://...]` (default: SQLite in a temporary directory and a
throwaway Postgres cluster with fsync off).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from unittest import mock

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from gateway.store import db  # noqa: E402
from gateway.store import records as store_records  # noqa: E402
from gateway.store.call_record import CallRecord  # noqa: E402
from gateway.store.records import LineageCache, write_calls  # noqa: E402
from gateway.store.tree import Candidate, LookupWork, find_parent, own_key  # noqa: E402
from tests.support.factories import make_record  # noqa: E402
from tests.support.pgcluster import PgCluster, create_database, drop_database  # noqa: E402


def trajectory(turns: int, turn_tokens: int, completion_tokens: int, sub_every: int, seed: int) -> list[CallRecord]:
    rng = random.Random(seed)
    main: list[int] = [rng.randrange(50_000) for _ in range(turn_tokens)]
    sub: list[int] = []
    out = []
    for turn in range(1, turns + 1):
        is_sub = sub_every > 0 and turn % sub_every == 0
        if is_sub:
            sub = [rng.randrange(50_000) for _ in range(turn_tokens)]  # a sub-agent: its own system prompt
            prompt = sub
        else:
            prompt = main
        completion = [rng.randrange(50_000) for _ in range(completion_tokens)]
        messages = [{"role": "system", "content": "sub" if is_sub else "main"}, {"role": "user", "content": str(turn)}]
        out.append(make_record("bench-traj", turn, prompt_token_ids=list(prompt), completion_token_ids=completion,
                               completion_logprobs=[-0.5] * completion_tokens,
                               request={"model": "run-a", "messages": messages}))  # fmt: skip
        if not is_sub:
            main = [*prompt, *completion, *(rng.randrange(50_000) for _ in range(turn_tokens))]
    return out


def write_all(url: str, calls: list[CallRecord], tree: bool) -> list[float]:
    """ms per call, each written in its own batch; `tree` false switches the lookup and the tree keys off."""
    db.upgrade(url)
    engine = db.make_engine(url)
    cache = LineageCache()  # the writer's
    times = []
    with ExitStack() as patches:
        if not tree:
            patches.enter_context(mock.patch.object(store_records, "place", lambda *a, **k: (None, None)))
            patches.enter_context(mock.patch.object(store_records, "_reparent_late", lambda *a, **k: None))
        try:
            for call in calls:
                started = time.perf_counter()
                write_calls(engine, [call], cache)
                times.append((time.perf_counter() - started) * 1000)
        finally:
            engine.dispose()
    return times


def lookup_alone(calls: list[CallRecord]) -> tuple[float, LookupWork, int]:
    """µs of find_parent for the last call against every earlier one (median of 50), its counted work, prompt length."""
    candidates = []
    for call in calls[:-1]:
        key = own_key(call.prompt_token_ids, call.completion_token_ids)
        assert key is not None
        candidates.append(Candidate(call.seq, 0, key[0], key[1]))
    last = calls[-1].prompt_token_ids
    samples = []
    for _ in range(50):
        started = time.perf_counter()
        find_parent(last, candidates)
        samples.append((time.perf_counter() - started) * 1e6)
    work = LookupWork()
    find_parent(last, candidates, work)
    return statistics.median(samples), work, len(last or [])


def report(backend: str, on: list[float], off: list[float]) -> None:
    tail_on, tail_off = statistics.median(on[-8:]), statistics.median(off[-8:])
    print(f"{backend:9} last 8 turns: {tail_on:7.2f} ms/call with the tree, {tail_off:7.2f} without "
          f"({tail_on - tail_off:+.2f}); all turns: {statistics.median(on):.2f} vs {statistics.median(off):.2f}")  # fmt: skip


def measure(urls: dict[str, Any], calls: list[CallRecord]) -> None:
    for backend, make_url in urls.items():
        on = write_all(make_url(), calls, tree=True)
        off = write_all(make_url(), calls, tree=False)
        report(backend, on, off)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--turns", type=int, default=64)
    parser.add_argument("--turn-tokens", type=int, default=400)
    parser.add_argument("--completion-tokens", type=int, default=60)
    parser.add_argument("--sub-every", type=int, default=8)
    parser.add_argument("--url", help="a Postgres server URL to use instead of a throwaway cluster")
    args = parser.parse_args()
    calls = trajectory(args.turns, args.turn_tokens, args.completion_tokens, args.sub_every, 0)
    print(f"{args.turns} turns, last prompt {len(calls[-2].prompt_token_ids or [])} ids, one call per batch")

    cluster = None
    server = args.url
    if server is None:
        cluster = PgCluster()
        cluster.start()
        server = cluster.url()
    made: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        counter = iter(range(10))

        def sqlite() -> str:
            return f"sqlite:///{tmp}/bench-{next(counter)}.db"

        def postgres() -> str:
            url = create_database(server.replace("postgresql://", "postgresql+psycopg://", 1))
            made.append(url)
            return url

        try:
            measure({"sqlite": sqlite, "postgres": postgres}, calls)
        finally:
            for url in made:
                drop_database(url)
            if cluster is not None:
                cluster.destroy()
    main_calls = [c for c in calls if (c.request or {})["messages"][0]["content"] == "main"]
    micros, work, length = lookup_alone(main_calls)
    print(f"find_parent alone at the last main turn: {micros:.0f} µs; hashed {work.ids_hashed} of its {length} prompt "
          f"ids, {work.digests} digests for {len(main_calls) - 1} candidates")  # fmt: skip


if __name__ == "__main__":
    main()
