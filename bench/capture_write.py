"""How fast captured calls reach the database through `write_calls`, the writer's only statement path.

Rows are shaped like the capture target of docs/design.md §14: 1,000 prompt ids + 200 completion ids + 200 logprobs and
~2 KB of request/response JSON, written in the writer's batches. Each run uses a fresh, migrated database and drops
it afterwards. Without --url it starts a throwaway cluster (fsync off, so faster than a real server).

    .venv/bin/python bench/capture_write.py
    .venv/bin/python bench/capture_write.py --url postgresql://postgres@127.0.0.1:5432/postgres
    .venv/bin/python bench/capture_write.py --url sqlite:////tmp/capture-bench.db
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere, like the other benchmarks
    sys.path.insert(0, str(REPO))

from sqlalchemy import Engine, text  # noqa: E402

from gateway.store import db  # noqa: E402
from gateway.store.call_record import CallRecord  # noqa: E402
from gateway.store.records import LineageCache, count_calls, write_calls  # noqa: E402
from tests.support.pgcluster import PgCluster, create_database, drop_database  # noqa: E402

TARGET_ROWS_S = 5_000


def make_records(count: int, seed: int = 0) -> list[CallRecord]:
    rng = random.Random(seed)
    content = "".join(rng.choice("abcdefghij klmnopqrstuvwxyz") for _ in range(900))
    return [
        CallRecord(
            id=uuid.uuid4().hex,
            run="bench",
            base_model="base",
            trajectory_id=f"traj-{i // 8}",
            group_id=f"group-{i // 64}",
            group_size=8,
            mode="train",
            seq=i % 8,
            choice_index=0,
            policy_version=0,
            endpoint="chat",
            stream=False,
            request={"model": "bench", "messages": [{"role": "user", "content": content}], "max_tokens": 200},
            response={"id": f"chatcmpl-{i}", "choices": [{"index": 0, "message": {"content": content}}]},
            prompt_token_ids=[rng.randrange(50_000) for _ in range(1000)],
            completion_token_ids=[rng.randrange(50_000) for _ in range(200)],
            completion_logprobs=[-rng.random() * 5 for _ in range(200)],
            finish_reason="stop",
            usage={"prompt_tokens": 1000, "completion_tokens": 200, "total_tokens": 1200},
            status_code=200,
            error=None,
            trainable=True,
            untrainable_reason=None,
            latency_ms=120.0,
            ttft_ms=None,
            retry_count=0,
            idempotency_key=None,
            created_at=time.time(),
        )
        for i in range(count)
    ]


def table_bytes(engine: Engine) -> int:
    if engine.dialect.name == "postgresql":
        query = "SELECT pg_total_relation_size('calls')"
    else:
        query = "SELECT SUM(pgsize) FROM dbstat WHERE name = 'calls' OR name LIKE 'sqlite_autoindex_calls%'"
    with engine.connect() as conn:
        return int(conn.execute(text(query)).scalar_one() or 0)


def measure(url: str, records: int, batch: int) -> None:
    db.upgrade(url)
    engine = db.make_engine(url)
    try:
        rows = make_records(records + batch)
        cache = LineageCache()  # the writer's
        write_calls(engine, rows[:batch], cache)  # connect and compile outside the timing
        before = table_bytes(engine)
        cpu, start = time.process_time(), time.perf_counter()
        for i in range(batch, len(rows), batch):
            write_calls(engine, rows[i : i + batch], cache)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        assert count_calls(engine) == len(rows)
        grown = table_bytes(engine) - before
        print(
            f"{engine.dialect.name}: {records:,} rows in {elapsed:.2f} s (batches of {batch}): "
            f"{records / elapsed:,.0f} rows/s, {grown / elapsed / 1e6:,.1f} MB/s into calls "
            f"({grown / records / 1e3:.1f} KB a row on disk), client CPU {cpu / records * 1e6:.0f} us a row"
        )
        if engine.dialect.name == "postgresql":
            verdict = "PASS" if records / elapsed >= TARGET_ROWS_S else "MISS"
            print(f"target (docs/design.md §14): >= {TARGET_ROWS_S:,} calls/s sustained into Postgres: {verdict}")
    finally:
        engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--url", help="Postgres server URL (a scratch database is made on it) or SQLite URL (recreated)"
    )
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=256, help="records per write_calls (the writer's batch_size)")
    args = parser.parse_args()

    if args.url and args.url.startswith("sqlite"):
        Path(args.url.removeprefix("sqlite:///")).unlink(missing_ok=True)
        measure(args.url, args.records, args.batch)
        return
    cluster = None
    server = args.url
    if server is None:
        cluster = PgCluster()
        cluster.start()
        server = cluster.url()
        print("throwaway cluster, fsync off")
    url = create_database(server.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        measure(url, args.records, args.batch)
    finally:
        drop_database(url)
        if cluster is not None:
            cluster.destroy()


if __name__ == "__main__":
    main()
