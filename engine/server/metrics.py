"""Prometheus metrics of one engine server, in a registry of its own (several apps can live in
one process, e.g. in tests, without clashing).

Fed by the engine's stat-logger hook: `record(scheduler_stats, iteration_stats)` is called on
the event loop after each batch of core outputs. Scheduler gauges and the connector's transfer
counters are exported from the latest snapshot at scrape time (the connector reports
cumulative values, so counters are *set*, never incremented here). Latency histograms and
token counters are fed from the per-iteration stats.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from engine.connector_api import ConnectorSpec
from engine.connector_registry import transfer_metrics
from engine.protocol import SchedulerStats

PREFIX = "pdserve:"


_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


def _field(stats: Any, name: str, default: Any = 0) -> Any:
    if stats is None:
        return default
    if isinstance(stats, Mapping):
        return stats.get(name, default)
    return getattr(stats, name, default)


class _SnapshotCollector(Collector):
    """Scheduler gauges and transfer counters from each engine's latest SchedulerStats."""

    def __init__(self, owner: ServerMetrics) -> None:
        self._owner = owner

    def collect(self) -> Iterable[Metric]:
        labels = self._owner.label_names
        engines = list(self._owner.engines.values())

        def gauge(name: str, doc: str, field: str, default: float = 0) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            for e in engines:
                g.add_metric(e.label_values, float(_field(e.latest, field, default)))
            return g

        yield gauge("num_requests_running", "Requests in the running batch.",
                    "num_running_reqs")
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.",
                    "num_waiting_reqs")
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).",
                    "kv_cache_usage", 0.0)
        yield gauge("num_free_kv_blocks", "Free KV cache blocks.", "num_free_blocks")
        # the connector's own counters and summaries (its spec names them), cumulative
        # values from SchedulerStats.kv_connector, keys with or without the prefix; a
        # server without a connector exports none (no kv_* series stuck at 0)
        counters, summaries = self._owner.transfer
        for name, doc in counters.items():
            c = CounterMetricFamily(PREFIX + name.removesuffix("_total"), doc, labels=labels)
            for e in engines:
                c.add_metric(e.label_values, float(e.connector.get(name, 0.0)))
            yield c
        for name, (doc, count_key) in summaries.items():
            s = SummaryMetricFamily(PREFIX + name, doc, labels=labels)
            for e in engines:
                kv = e.connector
                total = kv.get(name + "_sum", kv.get(name, 0.0))
                count = kv.get(name + "_count", kv.get(count_key, 0.0))
                s.add_metric(e.label_values, count_value=float(count), sum_value=float(total))
            yield s


class _EngineSeries:
    """The labelled series of one engine (label engine="<index>")."""

    def __init__(self, families: dict[str, Any], label_values: list[str]) -> None:
        self.label_values = label_values
        self.latest: SchedulerStats | Mapping[str, Any] | None = None
        self.connector: dict[str, float] = {}
        for name, family in families.items():
            setattr(self, name, family.labels(*label_values))


class ServerMetrics:
    """One server's metrics, one series per engine (data parallel: one per rank). `record`
    is the engine's stat-logger hook; the engine index picks the series."""

    def __init__(self, model_name: str, engine_index: int = 0,
                 engine_indexes: Iterable[int] | None = None, *,
                 with_transfer: bool = True, kv_spec: ConnectorSpec | None = None) -> None:
        """`with_transfer`: export the KV-transfer series, those of `kv_spec` (every registered
        connector's without one); False for a server without a connector."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.transfer: tuple[Mapping[str, str], Mapping[str, tuple[str, str]]] = ({}, {})
        if with_transfer:
            self.transfer = ((dict(kv_spec.counters), dict(kv_spec.summaries)) if kv_spec
                             else transfer_metrics())
        self.label_names = ["model_name", "engine"]
        reg = self.registry
        names = self.label_names
        families = {
            "prompt_tokens": Counter(PREFIX + "prompt_tokens", "Prefilled prompt tokens.",
                                     names, registry=reg),
            "generation_tokens": Counter(PREFIX + "generation_tokens", "Generated tokens.",
                                         names, registry=reg),
            "ttft": Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.",
                              names, buckets=_LATENCY_BUCKETS, registry=reg),
            "itl": Histogram(PREFIX + "inter_token_latency_seconds", "Inter-token latency.",
                             names, buckets=_ITL_BUCKETS, registry=reg),
            "e2e": Histogram(PREFIX + "e2e_request_latency_seconds", "End-to-end latency.",
                             names, buckets=_LATENCY_BUCKETS, registry=reg),
        }
        self.requests_finished = Counter(
            PREFIX + "request_success", "Finished requests by finish reason.",
            [*names, "finished_reason"], registry=reg)
        self.http_errors = Counter(
            PREFIX + "http_request_errors",
            "Error responses sent, by route (\"other\" for unknown paths) and HTTP status.",
            ["route", "status"], registry=reg)
        indexes = list(engine_indexes) if engine_indexes is not None else [engine_index]
        self.engines = {i: _EngineSeries(families, [model_name, str(i)]) for i in indexes}
        self._first = self.engines[indexes[0]]
        first = self._first
        self.prompt_tokens, self.generation_tokens = first.prompt_tokens, first.generation_tokens
        self.ttft, self.itl, self.e2e = first.ttft, first.itl, first.e2e
        reg.register(_SnapshotCollector(self))

    # --- the first engine's series (single-engine callers) ------------------------------
    @property
    def label_values(self) -> list[str]:
        return self._first.label_values

    @property
    def latest(self) -> Any:
        return self._first.latest

    def _series(self, engine_index: int | None) -> _EngineSeries:
        if engine_index is None:
            return self._first
        return self.engines.get(engine_index, self._first)

    # --- feeding -------------------------------------------------------------------------

    def record(self, scheduler_stats: Any = None, iteration_stats: Any = None,
               *_: Any, engine_index: int | None = None, **__: Any) -> None:
        """Stat-logger hook: the latest scheduler snapshot and one iteration's counts."""
        if scheduler_stats is not None:
            self.update_scheduler_stats(scheduler_stats, engine_index)
        if iteration_stats is not None:
            self.record_iteration(iteration_stats, engine_index)

    def update_scheduler_stats(self, stats: Any, engine_index: int | None = None) -> None:
        series = self._series(engine_index)
        series.latest = stats
        kv = _field(stats, "kv_connector", None)
        if kv:
            for key, value in dict(kv).items():
                try:
                    series.connector[str(key).removeprefix(PREFIX)] = float(value)
                except (TypeError, ValueError):
                    continue  # a malformed value is dropped, never raised into the loop

    def record_iteration(self, it: Any, engine_index: int | None = None) -> None:
        e = self._series(engine_index)
        e.prompt_tokens.inc(max(0, int(_field(it, "num_prompt_tokens"))))
        e.generation_tokens.inc(max(0, int(_field(it, "num_generation_tokens"))))
        for v in _field(it, "time_to_first_tokens_iter", ()) or ():
            e.ttft.observe(v)
        for v in _field(it, "inter_token_latencies_iter", ()) or ():
            e.itl.observe(v)
        for fin in _field(it, "finished_requests", ()) or ():
            e.e2e.observe(_field(fin, "e2e_latency", 0.0))
            reason = str(_field(fin, "finish_reason", "unknown"))
            self.requests_finished.labels(*e.label_values, reason).inc()

    def connector_values(self, engine_index: int | None = None) -> dict[str, float]:
        return dict(self._series(engine_index).connector)

    # --- exposition ----------------------------------------------------------------------

    def render(self) -> bytes:
        return generate_latest(self.registry)
