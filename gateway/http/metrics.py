"""Prometheus metrics for `GET /metrics`: traffic, latency the gateway adds, the writer's health, and each run's
training progress."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy.exc import SQLAlchemyError

from gateway.store.run_activity import RunGauges

log = logging.getLogger("trajgate.metrics")

WAIT_BUCKETS = (0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1)


class _WriterCollector(Collector):
    """Reads the writer's counters at scrape time, so the hot path doesn't update gauges per record. `stats` gives
    them by the field names of gateway.recorder.writer.WriterStats (as `dataclasses.asdict` of it), which this
    layer, below the recorder, reads without importing."""

    def __init__(self, stats: Callable[[], dict[str, float]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self._stats()
        yield GaugeMetricFamily("trajgate_writer_queue_depth", "Records waiting in memory", stats["queue_depth"])
        yield GaugeMetricFamily(
            "trajgate_writer_queue_bytes", "Bytes of spool lines of the records waiting in memory", stats["queue_bytes"]
        )
        yield GaugeMetricFamily(
            "trajgate_spool_bytes", "Bytes in the spool (the write-ahead log) not known stored", stats["spool_bytes"]
        )
        yield GaugeMetricFamily("trajgate_db_up", "1 if the writer can reach the database", float(stats["db_up"]))
        yield GaugeMetricFamily(
            "trajgate_records_held",
            "Records kept in memory because the spool could not be written",
            stats["records_held"],
        )
        yield CounterMetricFamily(
            "trajgate_records_logged",
            "Records appended to the spool before their answer completed",
            stats["records_logged"],
        )
        yield CounterMetricFamily(
            "trajgate_records_unlogged",
            "Records answered without a copy in the spool (it could not be written): a crash would lose them",
            stats["records_unlogged"],
        )
        yield CounterMetricFamily("trajgate_spool_syncs", "Group fsyncs of the spool", stats["syncs"])
        yield CounterMetricFamily(
            "trajgate_spool_sync_errors", "Failed fsyncs of the spool (safe from a crash, not power loss)",
            stats["sync_errors"],
        )
        yield CounterMetricFamily(
            "trajgate_records_written", "Records written to the database", stats["records_written"]
        )
        yield CounterMetricFamily(
            "trajgate_records_spooled",
            "Records dropped from memory, left for replay from the spool",
            stats["records_spooled"],
        )
        yield CounterMetricFamily(
            "trajgate_records_replayed", "Spooled records written to the database on replay", stats["records_replayed"]
        )
        yield CounterMetricFamily(
            "trajgate_records_rejected",
            "Records the database refused, kept in spool/rejected/",
            stats["records_rejected"],
        )
        yield CounterMetricFamily(
            "trajgate_records_lost", "Records neither stored nor kept on disk (see the log)", stats["records_lost"]
        )
        yield CounterMetricFamily(
            "trajgate_spool_unreadable_lines",
            "Spool lines replay could not read (torn by a crash): records lost, usually found at start-up",
            stats["records_unreadable"],
        )
        yield CounterMetricFamily(
            "trajgate_spool_errors", "Appends to the spool that failed (EMFILE, a full disk)", stats["spool_errors"]
        )
        yield CounterMetricFamily(
            "trajgate_writer_relief_turns",
            "Times a backlog or a waiter had the writer's loop taken over by its normal-priority thread (TRAJGATE_WRITER_NICE > 0)",
            stats["relief_turns"],
        )


class _ReplicaCollector(Collector):
    def __init__(self, replicas: Callable[[], list[tuple[str, bool, int]]]) -> None:
        self._replicas = replicas

    def collect(self) -> Iterator[GaugeMetricFamily]:
        up = GaugeMetricFamily("trajgate_replica_up", "1 while a vLLM replica is in rotation", labels=["replica"])
        in_flight = GaugeMetricFamily(
            "trajgate_replica_in_flight", "Calls a vLLM replica is answering now", labels=["replica"]
        )
        for url, healthy, calls in self._replicas():
            up.add_metric([url], 1.0 if healthy else 0.0)
            in_flight.add_metric([url], float(calls))
        yield up
        yield in_flight


class _RunCollector(Collector):
    """Each run's groups, step and trainer, read from the database at scrape time (never on the hot path) and kept
    for `ttl_s`, so several scrapers, or a scrape per gateway sharing one database, cost one read a second. One label
    value per existing run: a deleted run's series end with it. A database that cannot answer leaves the per-run
    series out of that scrape (the writer's `trajgate_db_up` says why) rather than failing the whole page."""

    def __init__(self, read: Callable[[], list[RunGauges]], ttl_s: float, slots: int | None) -> None:
        self._read = read
        self._ttl_s = ttl_s
        self._slots = slots
        self._lock = threading.Lock()
        self._cached: list[RunGauges] | None = []
        self._read_at = -float("inf")

    def _gauges(self) -> list[RunGauges] | None:
        """The runs' gauges, None when the database could not answer."""
        with self._lock:  # scrapes render in worker threads: one read at a time, the others reuse it
            if time.monotonic() - self._read_at >= self._ttl_s:
                try:
                    self._cached = self._read()
                except SQLAlchemyError as exc:
                    log.warning("per-run metrics left out: database unavailable: %s", type(exc).__name__)
                    self._cached = None
                self._read_at = time.monotonic()
            return self._cached

    def collect(self) -> Iterator[GaugeMetricFamily]:
        groups = GaugeMetricFamily(
            "trajgate_run_groups",
            "Training groups of a run by state: open (waiting for trajectories or rewards), ready, claimed",
            labels=["run", "state"],
        )
        step = GaugeMetricFamily(
            "trajgate_run_step", "The run's newest committed training step (0 before the first)", labels=["run"]
        )
        since = GaugeMetricFamily(
            "trajgate_run_seconds_since_step",
            "Seconds since the run's newest training step (absent before the first)",
            labels=["run"],
        )
        held = GaugeMetricFamily(
            "trajgate_run_trainer_held", "1 while a trainer holds an unexpired lease on the run", labels=["run"]
        )
        adapters = GaugeMetricFamily(
            "trajgate_run_adapters_loaded",
            "The run's adapters in vLLM: being published, routed to, or retired and not unloaded yet",
            labels=["run"],
        )
        runs = self._gauges()
        for run in runs or []:
            for state, count in run.groups.items():
                groups.add_metric([run.run, state], float(count))
            step.add_metric([run.run], float(run.step))
            if run.seconds_since_step is not None:
                since.add_metric([run.run], run.seconds_since_step)
            held.add_metric([run.run], 1.0 if run.trainer_held else 0.0)
            adapters.add_metric([run.run], float(run.adapters))
        yield groups
        yield step
        yield since
        yield held
        yield adapters
        if runs is not None:
            yield GaugeMetricFamily(
                "trajgate_adapter_slots_used",
                "vLLM adapter slots held by every run's adapters (of trajgate_adapter_slots_total)",
                sum(run.adapters for run in runs),
            )
        if self._slots is not None:
            yield GaugeMetricFamily(
                "trajgate_adapter_slots_total", "vLLM's adapter slots (TRAJGATE_VLLM_MAX_LORAS)", float(self._slots)
            )


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.run_registry = CollectorRegistry()
        self.requests = Counter(
            "trajgate_requests", "Requests by endpoint and status", ["endpoint", "status"], registry=self.registry
        )
        self.upstream_latency = Histogram(
            "trajgate_upstream_latency_seconds",
            "Time vLLM took (to the full body, or to the first chunk for streams), by the replica that answered",
            ["endpoint", "replica"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.added_latency = Histogram(
            "trajgate_added_latency_seconds",
            "Time the gateway itself added to a non-stream call",
            ["endpoint"],
            buckets=OVERHEAD_BUCKETS,
            registry=self.registry,
        )

        # Admission (gateway/proxy/admit.py), counted by this process: groups it admitted, calls it turned away
        # (rejected at once, or timed out waiting), calls waiting now, and how long admitted calls waited.
        self.admission_admitted = Counter(
            "trajgate_admission_admitted_groups", "New training groups admitted", ["run"], registry=self.registry
        )
        self.admission_refused = Counter(
            "trajgate_admission_refused",
            "Calls starting a group that got a 429 (reason: rejected or timed_out)",
            ["run", "reason"],
            registry=self.registry,
        )
        self.admission_waiting = Gauge(
            "trajgate_admission_waiting", "Calls waiting for room to start a group", ["run"], registry=self.registry
        )
        self.admission_wait = Histogram(
            "trajgate_admission_wait_seconds",
            "How long a call starting a group waited to be admitted",
            ["run"],
            buckets=WAIT_BUCKETS,
            registry=self.registry,
        )
        self.admission_errors = Counter(
            "trajgate_admission_errors",
            "Admission decisions the database could not make (the group was admitted)",
            registry=self.registry,
        )
        # Routing a group by its admitted version (gateway/proxy/admit.py): calls that waited for this process's route
        # table to catch up with a version their group was admitted on elsewhere, and calls vLLM answered 404 for an
        # adapter the trainer had retired, served again by the run's version now (gateway/proxy/hot_path.py).
        self.route_catchups = Counter(
            "trajgate_route_catchups",
            "Calls that reloaded this gateway's routes before routing: their group's version was newer",
            registry=self.registry,
        )
        self.retired_adapter_retries = Counter(
            "trajgate_retired_adapter_retries",
            "Calls answered 404 for a retired adapter and sent again to a version vLLM serves",
            registry=self.registry,
        )

        # Several gateways on one database (gateway/recorder/heartbeat.py): how long rewards, closes and judge requests waited
        # for the other gateways' writers, and how often that wait ran out.
        self.peer_wait = Histogram(
            "trajgate_peer_wait_seconds",
            "How long a reward, close or judge request waited for other gateways to write the calls they answered",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.peer_wait_timeouts = Counter(
            "trajgate_peer_wait_timeouts",
            "Reward, close or judge requests refused (503 gateways_behind) because another gateway had not written "
            "the calls it answered before them within TRAJGATE_PEER_WAIT_S",
            registry=self.registry,
        )
        # This gateway's own writer (gateway/recorder/heartbeat.py, `Peers._own_caught_up`).
        self.writer_wait_timeouts = Counter(
            "trajgate_writer_wait_timeouts",
            "Reward, close or judge requests refused (503 calls_not_written) because this gateway's writer had not "
            "stored the calls answered before them within TRAJGATE_WRITER_WAIT_S",
            registry=self.registry,
        )

        # Label children per label values: `labels()` takes a lock and validates its arguments on every call, three
        # times per model call on the hot path; the children themselves never change.
        self._children: dict[tuple[object, ...], Any] = {}

    def count_request(self, endpoint: str, status: int | str) -> None:
        key = ("requests", endpoint, status)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.requests.labels(endpoint, str(status))
        child.inc()

    def observe_upstream(self, endpoint: str, replica: str, seconds: float) -> None:
        key = ("upstream", endpoint, replica)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.upstream_latency.labels(endpoint, replica)
        child.observe(seconds)

    def observe_added(self, endpoint: str, seconds: float) -> None:
        key = ("added", endpoint)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.added_latency.labels(endpoint)
        child.observe(seconds)

    def watch_replicas(self, replicas: Callable[[], list[tuple[str, bool, int]]]) -> None:
        """(url, healthy, calls in flight) per vLLM replica, read at scrape time."""
        self.registry.register(_ReplicaCollector(replicas))

    def watch_responses(self, count: Callable[[], int], size: Callable[[], int]) -> None:
        """The Responses API's stored responses held in memory (TRAJGATE_RESPONSES_MEMORY_BYTES bounds the bytes)."""
        Gauge(
            "trajgate_responses_kept", "Stored Responses API answers held in memory", registry=self.registry
        ).set_function(count)
        Gauge(
            "trajgate_responses_kept_bytes",
            "Bytes (as JSON) of the stored Responses API answers held in memory",
            registry=self.registry,
        ).set_function(size)

    def watch_writer(self, stats: Callable[[], dict[str, float]]) -> None:
        self.registry.register(_WriterCollector(stats))

    def watch_runs(self, read: Callable[[], list[RunGauges]], ttl_s: float = 1.0, slots: int | None = None) -> None:
        """Per-run gauges from `read` (gateway.store.run_activity.run_gauges), at most once per `ttl_s`; `slots`:
        vLLM's adapter slots, when configured. They name every run, so they live in a registry of their own that
        `render` adds only for a reader allowed to see runs."""
        self.run_registry.register(_RunCollector(read, ttl_s, slots))

    def render(self, with_runs: bool = True) -> bytes:
        page = generate_latest(self.registry)
        return page + generate_latest(self.run_registry) if with_runs else page
