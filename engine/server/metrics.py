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

from engine.protocol import SchedulerStats

PREFIX = "pdserve:"

# Transfer metrics the connectors report in SchedulerStats.kv_connector (cumulative values;
# keys may carry the "pdserve:" prefix or not).
TRANSFER_COUNTERS: dict[str, str] = {
    "kv_push_registrations_sent_total": "Push registrations D sent to P.",
    "kv_push_registrations_received_total": "Push registrations P received from D.",
    "kv_push_writes_total": "KV WRITEs P completed into D's memory.",
    "kv_push_write_failures_total": "KV WRITEs that failed.",
    "kv_transfer_bytes_total": "Bytes of KV moved between engines.",
    "kv_lease_expired_total": "P block leases that expired before a WRITE.",
    "kv_registration_expired_total": "D registrations whose watchdog fired.",
    "kv_recv_failed_total": "Requests whose remote KV could not be received.",
    "kv_recompute_fallback_total": "Requests that fell back to computing the prompt locally.",
    "kv_remote_prefill_tokens_total": "Prompt tokens D received instead of computing.",
    "kv_push_fail_sent_total": "PUSH_FAIL notifications P sent (it will not write).",
    "kv_push_digest_mismatch_total": "Push registrations P refused: their prompt digest differs "
                                     "from the prompt P prefilled.",
    "kv_malformed_notifs_total": "Malformed KV notifications counted and dropped.",
    "kv_malformed_side_channel_total": "Malformed side-channel requests counted and dropped.",
    "kv_side_channel_refused_total": "Side-channel requests refused (no or wrong proof of the "
                                     "KV secret, stale nonce, address outside the allowlist).",
    "kv_handshake_refused_total": "Handshakes with peers refused either way (secret, allowlist).",
    "kv_refused_notifs_total": "KV notifications refused: not from the transfer's agent.",
    "kv_refused_peers_total": "Peer agent blobs refused: name already loaded from another "
                              "address.",
    "kv_pull_reads_total": "KV READs D completed from P (pull mode).",
    "kv_pull_leases_total": "Block leases P granted for pull reads.",
    "kv_pull_leases_returned_total": "Pull leases D returned to P.",
    "kv_pull_refused_params_total": "Pull transfer params D refused (stale or mismatched).",
}
TRANSFER_SECONDS = "kv_transfer_seconds"

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
    """Scheduler gauges and transfer counters from the latest SchedulerStats."""

    def __init__(self, owner: ServerMetrics) -> None:
        self._owner = owner

    def collect(self) -> Iterable[Metric]:
        stats = self._owner.latest
        labels = self._owner.label_names
        values = self._owner.label_values

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            g.add_metric(values, float(value))
            return g

        yield gauge("num_requests_running", "Requests in the running batch.",
                    _field(stats, "num_running_reqs"))
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.",
                    _field(stats, "num_waiting_reqs"))
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).",
                    _field(stats, "kv_cache_usage", 0.0))
        yield gauge("num_free_kv_blocks", "Free KV cache blocks.",
                    _field(stats, "num_free_blocks"))
        kv = self._owner.connector_values()
        for name, doc in TRANSFER_COUNTERS.items():
            c = CounterMetricFamily(PREFIX + name.removesuffix("_total"), doc, labels=labels)
            c.add_metric(values, float(kv.get(name, 0.0)))
            yield c
        s = SummaryMetricFamily(PREFIX + TRANSFER_SECONDS,
                                "Time spent moving KV between engines.", labels=labels)
        total = kv.get(TRANSFER_SECONDS + "_sum", kv.get(TRANSFER_SECONDS, 0.0))
        count = kv.get(TRANSFER_SECONDS + "_count", kv.get("kv_push_writes_total", 0.0))
        s.add_metric(values, count_value=float(count), sum_value=float(total))
        yield s


class ServerMetrics:
    """One server's metrics. `record` is the engine's stat-logger hook."""

    def __init__(self, model_name: str, engine_index: int = 0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.label_names = ["model_name", "engine"]
        self.label_values = [model_name, str(engine_index)]
        self.latest: SchedulerStats | Mapping[str, Any] | None = None
        self._connector: dict[str, float] = {}
        reg = self.registry
        names = self.label_names
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prefilled prompt tokens.",
                                     names, registry=reg).labels(*self.label_values)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.",
                                         names, registry=reg).labels(*self.label_values)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Time to first token.", names, buckets=_LATENCY_BUCKETS,
                              registry=reg).labels(*self.label_values)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Inter-token latency.",
                             names, buckets=_ITL_BUCKETS, registry=reg).labels(*self.label_values)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "End-to-end latency.",
                             names, buckets=_LATENCY_BUCKETS,
                             registry=reg).labels(*self.label_values)
        self.requests_finished = Counter(
            PREFIX + "request_success", "Finished requests by finish reason.",
            [*names, "finished_reason"], registry=reg)
        reg.register(_SnapshotCollector(self))

    # --- feeding -------------------------------------------------------------------------

    def record(self, scheduler_stats: Any = None, iteration_stats: Any = None,
               *_: Any, **__: Any) -> None:
        """Stat-logger hook: the latest scheduler snapshot and one iteration's counts."""
        if scheduler_stats is not None:
            self.update_scheduler_stats(scheduler_stats)
        if iteration_stats is not None:
            self.record_iteration(iteration_stats)

    def update_scheduler_stats(self, stats: Any) -> None:
        self.latest = stats
        kv = _field(stats, "kv_connector", None)
        if kv:
            for key, value in dict(kv).items():
                try:
                    self._connector[str(key).removeprefix(PREFIX)] = float(value)
                except (TypeError, ValueError):
                    continue  # a malformed value is dropped, never raised into the loop

    def record_iteration(self, it: Any) -> None:
        self.prompt_tokens.inc(max(0, int(_field(it, "num_prompt_tokens"))))
        self.generation_tokens.inc(max(0, int(_field(it, "num_generation_tokens"))))
        for v in _field(it, "time_to_first_tokens_iter", ()) or ():
            self.ttft.observe(v)
        for v in _field(it, "inter_token_latencies_iter", ()) or ():
            self.itl.observe(v)
        for fin in _field(it, "finished_requests", ()) or ():
            self.e2e.observe(_field(fin, "e2e_latency", 0.0))
            reason = str(_field(fin, "finish_reason", "unknown"))
            self.requests_finished.labels(*self.label_values, reason).inc()

    def connector_values(self) -> dict[str, float]:
        return dict(self._connector)

    # --- exposition ----------------------------------------------------------------------

    def render(self) -> bytes:
        return generate_latest(self.registry)
