"""vLLM's own metric families (`vllm:*`), served beside ours (`pdserve:*`) on every engine
server, so a dashboard or autoscaler written for vLLM reads this server unchanged.

Names, types, label names (`model_name`, `engine`; `finished_reason` on request_success) and
bucket bounds are vLLM v1's (vllm/v1/metrics/loggers.py). Beside, not behind a flag: a flag
would make the drop-in depend on a switch its users do not know about, while both families
cost a few hundred series lines per scrape; our own `pdserve:*` names keep existing dashboards
working. Only series that mean the same here are served (no LoRA, no spec-decode, no
deprecated gpu_* aliases).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

VLLM = "vllm:"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PREFILL_TOKEN_TIME_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


def _get(stats: Any, name: str, default: Any = 0) -> Any:
    if stats is None:
        return default
    if isinstance(stats, dict):
        return stats.get(name, default)
    return getattr(stats, name, default)


class _SchedulerCollector(Collector):
    """Gauges and the scheduler's cumulative counters from each engine's latest snapshot."""

    def __init__(self, owner: Any) -> None:
        self._owner = owner  # ServerMetrics: .engines (label_values, latest), .label_names

    def collect(self) -> Iterable[Metric]:
        engines = list(self._owner.engines.values())
        labels = self._owner.label_names
        rows = (("num_requests_running", "Number of requests in model execution batches.",
                 "num_running_reqs", GaugeMetricFamily),
                ("num_requests_waiting", "Number of requests waiting to be processed.",
                 "num_waiting_reqs", GaugeMetricFamily),
                ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                 "kv_cache_usage", GaugeMetricFamily),
                ("prefix_cache_queries",
                 "Prefix cache queries, in terms of number of queried tokens.",
                 "prefix_cache_queries", CounterMetricFamily),
                ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                 "prefix_cache_hits", CounterMetricFamily),
                ("num_preemptions", "Cumulative number of preemption from the engine.",
                 "num_preemptions", CounterMetricFamily))
        for name, doc, field, family in rows:
            f = family(VLLM + name, doc, labels=labels)
            for e in engines:
                f.add_metric(e.label_values, float(_get(e.latest, field, 0) or 0))
            yield f


class VllmFamilies:
    """vLLM's request-level families (fed per iteration) and its scheduler series."""

    def __init__(self, registry: CollectorRegistry, owner: Any, max_model_len: int) -> None:
        names = owner.label_names
        self._owner = owner

        def hist(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(VLLM + name, doc, names, buckets=list(buckets), registry=registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(VLLM + name, doc, names, registry=registry)

        lat, tokens = REQUEST_LATENCY_BUCKETS, build_1_2_5_buckets(max(1, max_model_len))
        self.families = {
            "prompt_tokens": counter("prompt_tokens", "Number of prefill tokens processed."),
            "generation_tokens": counter("generation_tokens",
                                         "Number of generation tokens processed."),
            "ttft": hist("time_to_first_token_seconds",
                         "Histogram of time to first token in seconds.", TTFT_BUCKETS),
            "itl": hist("inter_token_latency_seconds",
                        "Histogram of inter-token latency in seconds.", TPOT_BUCKETS),
            "tpot": hist("time_per_output_token_seconds",
                         "Histogram of time per output token in seconds.", TPOT_BUCKETS),
            "req_tpot": hist("request_time_per_output_token_seconds",
                             "Histogram of time_per_output_token_seconds per request.",
                             TPOT_BUCKETS),
            "e2e": hist("e2e_request_latency_seconds",
                        "Histogram of e2e request latency in seconds.", lat),
            "queue": hist("request_queue_time_seconds",
                          "Histogram of time spent in WAITING phase for request.", lat),
            "inference": hist("request_inference_time_seconds",
                              "Histogram of time spent in RUNNING phase for request.", lat),
            "prefill": hist("request_prefill_time_seconds",
                            "Histogram of time spent in PREFILL phase for request.", lat),
            "decode": hist("request_decode_time_seconds",
                           "Histogram of time spent in DECODE phase for request.", lat),
            "prefill_per_token": hist("time_per_prefill_token_request_seconds",
                                      "Time spent per token during prefill phase in seconds",
                                      PREFILL_TOKEN_TIME_BUCKETS),
            "req_prompt": hist("request_prompt_tokens", "Number of prefill tokens processed.",
                               tokens),
            "req_generation": hist("request_generation_tokens",
                                   "Number of generation tokens processed.", tokens),
            "iteration": hist("iteration_tokens_total",
                              "Histogram of number of tokens per engine_step.",
                              ITERATION_TOKEN_BUCKETS),
        }
        self.success = Counter(VLLM + "request_success",
                               "Count of successfully processed requests.",
                               [*names, "finished_reason"], registry=registry)
        self._children: dict[tuple[str, ...], dict[str, Any]] = {}
        for e in owner.engines.values():  # every reason's series exists from the start
            for reason in FINISH_REASONS:
                self.success.labels(*e.label_values, reason)
            self.children(e.label_values)
        registry.register(_SchedulerCollector(owner))

    def children(self, label_values: list[str]) -> dict[str, Any]:
        key = tuple(label_values)
        kids = self._children.get(key)
        if kids is None:
            kids = {k: f.labels(*label_values) for k, f in self.families.items()}
            self._children[key] = kids
        return kids

    def record_iteration(self, it: Any, label_values: list[str]) -> None:
        k = self.children(label_values)
        prompt = max(0, int(_get(it, "num_prompt_tokens")))
        generation = max(0, int(_get(it, "num_generation_tokens")))
        k["prompt_tokens"].inc(prompt)
        k["generation_tokens"].inc(generation)
        if prompt + generation:
            k["iteration"].observe(prompt + generation)
        for v in _get(it, "time_to_first_tokens_iter", ()) or ():
            k["ttft"].observe(v)
        for v in _get(it, "inter_token_latencies_iter", ()) or ():
            k["itl"].observe(v)
            k["tpot"].observe(v)
        for fin in _get(it, "finished_requests", ()) or ():
            self._finished(fin, k, label_values)

    def _finished(self, fin: Any, k: dict[str, Any], label_values: list[str]) -> None:
        self.success.labels(*label_values, str(_get(fin, "finish_reason", "unknown"))).inc()
        k["e2e"].observe(float(_get(fin, "e2e_latency", 0.0)))
        prefill, decode = float(_get(fin, "prefill_time", 0.0)), float(_get(fin, "decode_time"))
        k["queue"].observe(float(_get(fin, "queued_time", 0.0)))
        k["prefill"].observe(prefill)
        k["decode"].observe(decode)
        k["inference"].observe(prefill + decode)
        n_prompt = int(_get(fin, "num_prompt_tokens", 0))
        n_gen = int(_get(fin, "num_generation_tokens", 0))
        if n_prompt > 0:
            k["prefill_per_token"].observe(prefill / n_prompt)
        if n_gen > 1:
            k["req_tpot"].observe(decode / (n_gen - 1))
        k["req_prompt"].observe(n_prompt)
        k["req_generation"].observe(n_gen)
