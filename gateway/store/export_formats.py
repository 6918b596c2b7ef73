"""`trajgate export`: a run's trajectories as JSON Lines or Parquet, streamed (constant memory for large runs).

One record per trajectory, its calls nested in turn order; the schema is in docs/api.md. JSON has no infinity, so a
logprob of -inf (a token vLLM forced) is written as null in JSON Lines; Parquet keeps it. In Parquet the free-form
JSON fields (messages, tool_calls, metrics, metadata) are JSON-encoded strings.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import IO, Any

import orjson

FORMATS = ("jsonl", "parquet")
ROW_GROUP_TRAJECTORIES = 256


class ExportError(Exception):
    """The export cannot run as asked (a missing optional dependency); the message says what to do."""


def write_jsonl(trajectories: Iterable[dict[str, Any]], out: IO[bytes]) -> int:
    """One JSON object per line; returns how many were written."""
    count = 0
    for trajectory in trajectories:
        out.write(orjson.dumps(trajectory, option=orjson.OPT_APPEND_NEWLINE))
        count += 1
    return count


def _parquet_schema() -> Any:
    import pyarrow as pa

    call = pa.struct(
        [
            ("turn", pa.int32()),
            ("seq", pa.int64()),
            ("choice_index", pa.int32()),
            ("policy_version", pa.int32()),
            ("endpoint", pa.string()),
            ("messages", pa.string()),
            ("completion", pa.string()),
            ("tool_calls", pa.string()),
            ("prompt_token_ids", pa.list_(pa.int32())),
            ("completion_token_ids", pa.list_(pa.int32())),
            ("completion_logprobs", pa.list_(pa.float32())),
            ("finish_reason", pa.string()),
            ("trainable", pa.bool_()),
            ("merge_reason", pa.string()),
            ("segment_reason", pa.string()),
            ("divergence", pa.int32()),
            ("parent", pa.struct([("seq", pa.int64()), ("choice_index", pa.int32())])),
            ("branch", pa.int64()),
        ]
    )
    return pa.schema(
        [
            ("trajectory_id", pa.string()),
            ("run", pa.string()),
            ("group_id", pa.string()),
            ("mode", pa.string()),
            ("reward", pa.float64()),
            ("metrics", pa.string()),
            ("metadata", pa.string()),
            ("calls", pa.list_(call)),
        ]
    )


def _json_text(value: Any) -> str | None:
    return None if value is None else orjson.dumps(value).decode()


def _parquet_row(trajectory: dict[str, Any]) -> dict[str, Any]:
    row = {**trajectory, "metrics": _json_text(trajectory["metrics"]), "metadata": _json_text(trajectory["metadata"])}
    row["calls"] = [
        {**call, "messages": _json_text(call["messages"]), "tool_calls": _json_text(call["tool_calls"])}
        for call in trajectory["calls"]
    ]
    return row


def _batches(trajectories: Iterable[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    batch: list[dict[str, Any]] = []
    for trajectory in trajectories:
        batch.append(_parquet_row(trajectory))
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def check_available(export_format: str) -> None:
    """Raise ExportError now, before any output is opened, if the format's optional dependency is missing."""
    if export_format == "parquet":
        try:
            import pyarrow.parquet  # noqa: F401
        except ImportError:
            raise ExportError(
                "Parquet export needs pyarrow: pip install 'trajgate[export]' (or use --format jsonl)"
            ) from None


def write_parquet(
    trajectories: Iterable[dict[str, Any]], out: IO[bytes], row_group: int = ROW_GROUP_TRAJECTORIES
) -> int:
    """Parquet, one row group per `row_group` trajectories so memory holds one row group at a time."""
    check_available("parquet")
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = _parquet_schema()
    count = 0
    with pq.ParquetWriter(pa.PythonFile(out, mode="w"), schema) as writer:
        for batch in _batches(trajectories, row_group):
            writer.write_table(pa.Table.from_pylist(batch, schema=schema))
            count += len(batch)
    return count
