"""Prometheus metrics of one engine server, in a registry of its own (several apps can live in
one process, e.g. in tests, without clashing).

Fed by the engine's stat-logger hook: `record(scheduler_stats, iteration_stats)` is called on
the event loop after each batch of core outputs. Scheduler gauges and the connector's transfer
counters are exported from the latest snapshot at scrape time (the connector reports
cumulative values, so counters are *set*, never incremented here). Latency histograms and
token counters are fed from the per-iteration stats.

vLLM's own families (`vllm:*`, engine/server/vllm_metrics.py) live in the same registry, fed
by the same hook. A connector's timings (its spec's `summaries`) are served as histograms:
cumulative `<name>_bucket:<le>` keys in its stats are the buckets.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from engine.connector_api import ConnectorSpec
from engine.connector_registry import transfer_metrics
from engine.protocol import SchedulerStats
from engine.server.vllm_metrics import REQUEST_LATENCY_BUCKETS, VllmFamilies

PREFIX = "pdserve:"


_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_DEFAULT_MAX_MODEL_LEN = 32768  # vLLM's token buckets where no model length was bound
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
        # the connector's own counters and timings (its spec names them; a spec's
        # `summaries` are served as histograms), cumulative
        # values from SchedulerStats.kv_connector, keys with or without the prefix; a
        # server without a connector exports none (no kv_* series stuck at 0)
        counters, summaries = self._owner.transfer
        for name, doc in counters.items():
            c = CounterMetricFamily(PREFIX + name.removesuffix("_total"), doc, labels=labels)
            for e in engines:
                c.add_metric(e.label_values, float(e.connector.get(name, 0.0)))
            yield c
        for name, (doc, count_key) in summaries.items():
            yield _transfer_histogram(PREFIX + name, doc, labels, engines, name, count_key)


def _transfer_histogram(full_name: str, doc: str, labels: list[str], engines: list[Any],
                        name: str, count_key: str) -> HistogramMetricFamily:
    """A connector's timing as a histogram (aiperf skips a Summary without quantiles): its
    cumulative `<name>_bucket:<le>` keys are the buckets, `<name>_sum`/`_count` the rest; a
    connector reporting no bucket keys gets the +Inf bucket alone."""
    prefix = name + "_bucket:"
    per_engine: list[dict[float, float]] = []
    for e in engines:
        bounds: dict[float, float] = {}
        for key, value in e.connector.items():
            if key.startswith(prefix):
                try:
                    bounds[float(key[len(prefix):])] = float(value)
                except ValueError:
                    continue  # a malformed bound is dropped
        per_engine.append(bounds)
    les = sorted({le for b in per_engine for le in b if le != float("inf")})
    h = HistogramMetricFamily(full_name, doc, labels=labels)
    for e, bounds in zip(engines, per_engine, strict=True):
        kv = e.connector
        total = float(kv.get(name + "_sum", kv.get(name, 0.0)))
        count = float(kv.get(name + "_count", kv.get(count_key, 0.0)))
        buckets, running = [], 0.0
        for le in les:
            running = max(running, bounds.get(le, 0.0))  # racy reads stay monotone
            buckets.append((floatToGoString(le), running))
        buckets.append(("+Inf", max(running, count)))
        h.add_metric(e.label_values, buckets=buckets, sum_value=total)
    return h


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
                 with_transfer: bool = True, kv_spec: ConnectorSpec | None = None,
                 max_model_len: int | None = None) -> None:
        """`with_transfer`: export the KV-transfer series, those of `kv_spec` (every registered
        connector's without one); False for a server without a connector. `max_model_len`:
        vLLM's families are created with it (or by `bind_max_model_len`, or with a default on
        the first recorded iteration)."""
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
                             names, buckets=REQUEST_LATENCY_BUCKETS, registry=reg),
        }
        self.requests_finished = Counter(
            PREFIX + "request_success", "Finished requests by finish reason.",
            [*names, "finished_reason"], registry=reg)
        self.http_errors = Counter(
            PREFIX + "http_request_errors",
            "Error responses sent, by route (\"other\" for unknown paths) and HTTP status.",
            ["route", "status"], registry=reg)
        self.prompt_tokenizations = Counter(
            PREFIX + "prompt_tokenizations",
            "Prompts by where their token ids came from: encoded (this server rendered and "
            "tokenized the text) or given (token ids in the request: a token-id prompt, or "
            "prompt_token_ids from a proxy that tokenized once).", ["source"], registry=reg)
        indexes = list(engine_indexes) if engine_indexes is not None else [engine_index]
        self.engines = {i: _EngineSeries(families, [model_name, str(i)]) for i in indexes}
        self._first = self.engines[indexes[0]]
        first = self._first
        self.prompt_tokens, self.generation_tokens = first.prompt_tokens, first.generation_tokens
        self.ttft, self.itl, self.e2e = first.ttft, first.itl, first.e2e
        reg.register(_SnapshotCollector(self))
        self.vllm: VllmFamilies | None = None
        if max_model_len:
            self.bind_max_model_len(max_model_len)

    def bind_max_model_len(self, max_model_len: int) -> None:
        """Create vLLM's families (its token-count buckets go up to max_model_len); the first
        call wins, later ones are no-ops."""
        if self.vllm is None:
            self.vllm = VllmFamilies(self.registry, self, int(max_model_len))

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
        if self.vllm is None:
            self.bind_max_model_len(_DEFAULT_MAX_MODEL_LEN)
        assert self.vllm is not None
        self.vllm.record_iteration(it, e.label_values)

    def connector_values(self, engine_index: int | None = None) -> dict[str, float]:
        return dict(self._series(engine_index).connector)

    # --- exposition ----------------------------------------------------------------------

    def render(self) -> bytes:
        return generate_latest(self.registry)
