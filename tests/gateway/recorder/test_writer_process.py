"""The record writer with its database work in a process of its own (gateway.recorder.writer_process, TRAJGATE_WRITER_PROCESS):
records still all reach Postgres, a child that dies loses nothing, a refused record is set aside alone, and the
gateway wires it up on Postgres only."""

from __future__ import annotations

import array
import fcntl
import os
import signal
import termios
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from sqlalchemy import Engine

from gateway.recorder.writer import RecordWriter, spool_line
from gateway.recorder.writer_process import WriteFailed, WriterProcess
from gateway.store import db
from gateway.store.call_record import CallRecord
from gateway.store.records import count_calls
from tests.support.factories import make_record
from tests.support.fake_upstream import FakeUpstream
from tests.support.gateway_harness import running_gateway
from tests.support.pgcluster import free_port
from tests.support.waiting import wait_until


@pytest.fixture
def pg_engine(pg_url: str) -> Iterator[Engine]:
    db.upgrade(pg_url)
    engine = db.make_engine(pg_url)
    yield engine
    engine.dispose()


def _records(prefix: str, count: int) -> list[CallRecord]:
    return [make_record(f"{prefix}-{n}", 0, seed=n) for n in range(count)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_records_are_written_by_the_child_process(pg_url: str, pg_engine: Engine, tmp_path: Path) -> None:
    process = WriterProcess(pg_url, nice=0)
    writer = RecordWriter(pg_engine, tmp_path / "spool", flush_interval_s=0.01, process=process)
    writer.start()
    try:
        for record in _records("p", 40):
            writer.submit(record)
        assert writer.flush(30)
        assert count_calls(pg_engine) == 40 and writer.counters.records_written == 40
        child = process.pid
        assert child is not None and child != os.getpid() and _alive(child)
    finally:
        writer.close()
    wait_until(lambda: not _alive(child), 10, "the writer process to end with the writer")
    assert process.starts == 1 and writer.counters.records_lost == 0


def test_a_child_that_dies_mid_batch_loses_nothing(pg_url: str, pg_engine: Engine, tmp_path: Path) -> None:
    """The batch a child held when it died is an outage: let go to the log, replayed through a new child."""
    process = WriterProcess(pg_url, nice=0)
    writer = RecordWriter(
        pg_engine, tmp_path / "spool", flush_interval_s=0.01, retry_interval_s=0.1, segment_age_s=0.1, process=process
    )
    writer.start()
    try:
        for record in _records("before", 10):
            writer.submit(record)
        assert writer.flush(30)
        first = process.pid
        assert first is not None
        os.kill(first, signal.SIGSTOP)  # the next batch is sent and waits for an answer that never comes
        for record in _records("after", 25):
            writer.submit(record)
        wait_until(lambda: _unread(process) > 0, 10, "a batch sent to the stopped child")
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: count_calls(pg_engine) == 35, 30, "every record stored after the child died")
        assert writer.flush(30)
        assert process.starts == 2 and process.pid != first
        # It went through the log. The replay counts its records once it has finished, just after its last batch
        # commits (and `flush` does not wait on the log while the database is marked down): so wait for the count.
        wait_until(lambda: writer.counters.records_replayed >= 1, 10, "the replay to be counted")
        assert writer.counters.records_spooled >= 1
    finally:
        writer.close()
    assert writer.counters.records_lost == 0 and writer.counters.records_rejected == 0


def _unread(process: WriterProcess) -> int:
    """Bytes waiting in the pipe to the child (FIONREAD answers for either end of a pipe)."""
    proc = process._proc
    if proc is None or proc.stdin is None:
        return 0
    count = array.array("i", [0])
    fcntl.ioctl(proc.stdin.fileno(), termios.FIONREAD, count)
    return count[0]


def test_a_refused_record_is_set_aside_alone(pg_url: str, pg_engine: Engine, tmp_path: Path) -> None:
    """The child says which failures are the records' own; the writer then bisects the batch as on its thread."""
    process = WriterProcess(pg_url, nice=0)
    writer = RecordWriter(pg_engine, tmp_path / "spool", flush_interval_s=0.2, process=process)
    good = _records("good", 6)
    bad = make_record("bad", 0, prompt_token_ids=[2**40])  # cannot be stored as int32
    writer.start()
    try:
        for record in [*good[:3], bad, *good[3:]]:
            writer.submit(record)
        assert writer.flush(30)
    finally:
        writer.close()
    assert count_calls(pg_engine) == 6 and writer.counters.records_rejected == 1
    rejected = (tmp_path / "spool" / "rejected").glob("*.jsonl")
    assert [line.count(b"\n") for line in (path.read_bytes() for path in rejected)] == [1]


def test_a_database_that_is_not_there_is_an_outage_not_a_refusal() -> None:
    process = WriterProcess(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/postgres", nice=0)
    try:
        with pytest.raises(WriteFailed) as failed:
            process.write([spool_line(make_record("t", 0))])
    finally:
        process.close()
    assert failed.value.record is False


def test_the_gateway_uses_it_on_postgres_only(
    upstream: FakeUpstream, pg_url: str, sqlite_url: str, tmp_path: Path
) -> None:
    upstream.mode = "replay"
    common = {"upstream_url": upstream.base_url, "base_model": "smollm2", "writer_process": True}
    plain, stream = (  # what an agent sends for these recordings: without what the gateway injects
        {**{k: v for k, v in upstream.fixture(name)["request"].items() if k not in ("logprobs", "return_token_ids")},
         "model": "my-agent"}
        for name in ("chat", "chat_stream")
    )
    with running_gateway(database_url=pg_url, spool_dir=tmp_path / "pg", **common) as gateway:
        client = openai.OpenAI(base_url=gateway.base_url, api_key="sk", max_retries=0)
        client.chat.completions.create(**plain)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(**stream)
                       if chunk.choices)
        gateway.flush()
        process = gateway.app.state.writer._process
        assert process is not None and process.pid is not None and _alive(process.pid)
        engine = db.make_engine(pg_url)
        try:
            assert count_calls(engine) == 2
        finally:
            engine.dispose()
    with running_gateway(database_url=sqlite_url, spool_dir=tmp_path / "lite", **common) as gateway:
        assert gateway.app.state.writer._process is None
