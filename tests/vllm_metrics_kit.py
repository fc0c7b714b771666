"""vLLM's metric families as vLLM v1 defines them (vllm/v1/metrics/loggers.py), written out
here independently of engine/server/vllm_metrics.py, and the helpers that check a live
server's /metrics against them and the Grafana dashboard's queries against live series."""

from __future__ import annotations

import pathlib
import re
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TPOT = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0]
REQUEST = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
TOKENS_1024 = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]  # build_1_2_5_buckets(1024)
ITERATION = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
PREFILL_PER_TOKEN = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]
ENGINE_LABELS = {"model_name", "engine"}

# family (counters without _total) -> (type, extra label names, bucket bounds or None)
VLLM_FAMILIES: dict[str, tuple[str, set[str], list[float] | None]] = {
    "vllm:num_requests_running": ("gauge", set(), None),
    "vllm:num_requests_waiting": ("gauge", set(), None),
    "vllm:kv_cache_usage_perc": ("gauge", set(), None),
    "vllm:prefix_cache_queries": ("counter", set(), None),
    "vllm:prefix_cache_hits": ("counter", set(), None),
    "vllm:num_preemptions": ("counter", set(), None),
    "vllm:prompt_tokens": ("counter", set(), None),
    "vllm:generation_tokens": ("counter", set(), None),
    "vllm:request_success": ("counter", {"finished_reason"}, None),
    "vllm:time_to_first_token_seconds": ("histogram", set(), TTFT),
    "vllm:inter_token_latency_seconds": ("histogram", set(), TPOT),
    "vllm:time_per_output_token_seconds": ("histogram", set(), TPOT),
    "vllm:request_time_per_output_token_seconds": ("histogram", set(), TPOT),
    "vllm:e2e_request_latency_seconds": ("histogram", set(), REQUEST),
    "vllm:request_queue_time_seconds": ("histogram", set(), REQUEST),
    "vllm:request_inference_time_seconds": ("histogram", set(), REQUEST),
    "vllm:request_prefill_time_seconds": ("histogram", set(), REQUEST),
    "vllm:request_decode_time_seconds": ("histogram", set(), REQUEST),
    "vllm:time_per_prefill_token_request_seconds": ("histogram", set(), PREFILL_PER_TOKEN),
    "vllm:request_prompt_tokens": ("histogram", set(), TOKENS_1024),
    "vllm:request_generation_tokens": ("histogram", set(), TOKENS_1024),
    "vllm:iteration_tokens_total": ("histogram", set(), ITERATION),
}


def scrape(url: str) -> dict[str, Any]:
    """A server's families by name (a counter's without _total)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {f.name.removesuffix("_total") if f.type == "counter" else f.name: f
            for f in text_string_to_metric_families(text)}


def bounds(family: Any) -> list[float]:
    """The finite bucket bounds of a histogram family (every series must have the same)."""
    per_series: dict[tuple, list[float]] = {}
    for s in family.samples:
        if s.name.endswith("_bucket"):
            key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
            per_series.setdefault(key, []).append(float(s.labels["le"]))
    lists = {tuple(v) for v in per_series.values()}
    assert len(lists) == 1, f"{family.name}: series disagree on buckets: {lists}"
    les = list(lists.pop())
    assert les[-1] == float("inf"), f"{family.name}: no +Inf bucket"
    return les[:-1]


def check_vllm_families(families: dict[str, Any], model: str) -> list[str]:
    """Every vLLM family: present, its type, its label names, its buckets. The problems."""
    bad = []
    for name, (kind, extra, buckets) in VLLM_FAMILIES.items():
        f = families.get(name)
        if f is None:
            bad.append(f"{name}: missing")
            continue
        if f.type != kind:
            bad.append(f"{name}: type {f.type}, vLLM's is {kind}")
        if not f.samples:
            bad.append(f"{name}: no series")
        for s in f.samples:
            labels = set(s.labels) - {"le"}
            if labels != ENGINE_LABELS | extra:
                bad.append(f"{name}: labels {sorted(labels)}")
            elif s.labels["model_name"] != model:
                bad.append(f"{name}: model_name {s.labels['model_name']!r}")
        if buckets is not None and f.samples and bounds(f) != buckets:
            bad.append(f"{name}: buckets {bounds(f)} != vLLM's {buckets}")
    return bad


def value(families: dict[str, Any], sample: str, **labels: str) -> float:
    """Sum of the samples named `sample` (all label sets matching `labels`)."""
    for f in families.values():
        total = [s.value for s in f.samples if s.name == sample
                 and all(s.labels.get(k) == v for k, v in labels.items())]
        if total:
            return sum(total)
    return 0.0


DASHBOARD = pathlib.Path(__file__).resolve().parents[1] / "docs" / "grafana" / "pdserve.json"
_METRIC = re.compile(r"[A-Za-z_][A-Za-z0-9_]*:[A-Za-z0-9_:]*")


def dashboard_queries(dashboard: dict) -> list[str]:
    """Every PromQL expression of a dashboard: panel targets (rows' nested panels too) and
    the templating queries."""
    out = []

    def walk(panels: list[dict]) -> None:
        for p in panels:
            out.extend(t["expr"] for t in p.get("targets", []) if t.get("expr"))
            walk(p.get("panels", []))

    walk(dashboard.get("panels", []))
    for var in dashboard.get("templating", {}).get("list", []):
        q = var.get("query")
        out.append(q if isinstance(q, str) else (q or {}).get("query", ""))
    return [q for q in out if q]


def metric_names(expr: str) -> set[str]:
    """The series names an expression selects (every pdserve and vLLM name has a colon, no
    PromQL function, label or duration does)."""
    return set(_METRIC.findall(expr))
