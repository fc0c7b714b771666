"""Writes docs/grafana/pdserve.json, the Grafana dashboard of a pdserve deployment: serving
(vLLM's own panels and series, so a vLLM dashboard's queries read the same here) and P/D
transfer (the connector's kv_* series on P and D, the proxy's series). Run it after editing:
`python docs/grafana/make_dashboard.py`. tests/integration/test_vllm_compat_pd.py checks
that every query names a series a live P, D and proxy export."""

from __future__ import annotations

import json
import pathlib

SEL = '{model_name=~"$model_name"}'
RATE = "[$__rate_interval]"


def quantiles(metric: str, by: str = "le") -> list[str]:
    return [f"histogram_quantile({q}, sum by ({by}) (rate({metric}_bucket{SEL}{RATE})))"
            for q in (0.5, 0.9, 0.99)] + [
        f"sum(rate({metric}_sum{SEL}{RATE})) / sum(rate({metric}_count{SEL}{RATE}))"]


def proxy_quantiles(metric: str) -> list[str]:
    return [f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{RATE})))"
            for q in (0.5, 0.99)]


SERVING = [
    ("Time to first token (s): p50, p90, p99, mean", quantiles("vllm:time_to_first_token_seconds")),
    ("Inter-token latency (s)", quantiles("vllm:inter_token_latency_seconds")),
    ("Time per output token (s)", quantiles("vllm:time_per_output_token_seconds")),
    ("Time per output token, per request (s)",
     quantiles("vllm:request_time_per_output_token_seconds")),
    ("End-to-end request latency (s)", quantiles("vllm:e2e_request_latency_seconds")),
    ("Token throughput (tokens/s): prompt, generation",
     [f"sum(rate(vllm:prompt_tokens_total{SEL}{RATE}))",
      f"sum(rate(vllm:generation_tokens_total{SEL}{RATE}))"]),
    ("Scheduler state: running, waiting",
     [f"sum by (engine) (vllm:num_requests_running{SEL})",
      f"sum by (engine) (vllm:num_requests_waiting{SEL})"]),
    ("KV cache usage (0-1)", [f"max by (engine) (vllm:kv_cache_usage_perc{SEL})"]),
    ("Prefix cache hit rate",
     [f"sum(rate(vllm:prefix_cache_hits_total{SEL}{RATE})) / "
      f"sum(rate(vllm:prefix_cache_queries_total{SEL}{RATE}))"]),
    ("Request phases, mean (s): queue, prefill, decode, inference",
     [f"sum(rate(vllm:request_{p}_time_seconds_sum{SEL}{RATE})) / "
      f"sum(rate(vllm:request_{p}_time_seconds_count{SEL}{RATE}))"
      for p in ("queue", "prefill", "decode", "inference")]),
    ("Prefill time per prompt token (s)", quantiles("vllm:time_per_prefill_token_request_seconds")),
    ("Finished requests by reason (req/s)",
     [f"sum by (finished_reason) (rate(vllm:request_success_total{SEL}{RATE}))"]),
    ("Preemptions (/s)", [f"sum(rate(vllm:num_preemptions_total{SEL}{RATE}))"]),
    ("Prompt length (tokens), p50 / p99",
     [f"histogram_quantile({q}, sum by (le) (rate(vllm:request_prompt_tokens_bucket{SEL}{RATE})))"
      for q in (0.5, 0.99)]),
    ("Generation length (tokens), p50 / p99",
     [f"histogram_quantile({q}, sum by (le) "
      f"(rate(vllm:request_generation_tokens_bucket{SEL}{RATE})))" for q in (0.5, 0.99)]),
    ("Tokens per engine step, p50 / p99",
     [f"histogram_quantile({q}, sum by (le) (rate(vllm:iteration_tokens_total_bucket{SEL}{RATE})))"
      for q in (0.5, 0.99)]),
]

PD = [
    ("KV transfer time (s): p50, p90, p99, mean", quantiles("pdserve:kv_transfer_seconds")),
    ("KV transfer bandwidth (bytes/s)",
     [f"sum by (engine) (rate(pdserve:kv_transfer_bytes_total{SEL}{RATE}))"]),
    ("KV transfers (/s): push WRITEs, pull READs, failures",
     [f"sum(rate(pdserve:kv_push_writes_total{SEL}{RATE}))",
      f"sum(rate(pdserve:kv_pull_reads_total{SEL}{RATE}))",
      f"sum(rate(pdserve:kv_push_write_failures_total{SEL}{RATE}))",
      f"sum(rate(pdserve:kv_recv_failed_total{SEL}{RATE}))"]),
    ("Prompt tokens prefilled elsewhere (D, tokens/s)",
     [f"sum(rate(pdserve:kv_remote_prefill_tokens_total{SEL}{RATE}))"]),
    ("D's first token: seeded from P vs recomputed (/s)",
     [f"sum(rate(pdserve:kv_first_token_seeded_total{SEL}{RATE}))",
      f"sum(rate(pdserve:kv_first_token_recomputed_total{SEL}{RATE}))"]),
    ("Recovery (/s): recompute fallbacks, expired leases, expired registrations",
     [f"sum(rate(pdserve:kv_recompute_fallback_total{SEL}{RATE}))",
      f"sum(rate(pdserve:kv_lease_expired_total{SEL}{RATE}))",
      f"sum(rate(pdserve:kv_registration_expired_total{SEL}{RATE}))"]),
    ("Refused / malformed peer traffic (/s)",
     [f"sum(rate(pdserve:kv_malformed_notifs_total{SEL}{RATE}))",
      f"sum(rate(pdserve:kv_malformed_side_channel_total{SEL}{RATE}))",
      f"sum(rate(pdserve:kv_side_channel_refused_total{SEL}{RATE}))",
      f"sum(rate(pdserve:kv_handshake_refused_total{SEL}{RATE}))"]),
    ("Proxy: time to first byte from D (s), p50 / p99",
     proxy_quantiles("pdserve:proxy_ttft_seconds")),
    ("Proxy: end-to-end latency (s), p50 / p99",
     proxy_quantiles("pdserve:proxy_e2e_request_latency_seconds")),
    ("Proxy: requests by status (req/s)",
     [f"sum by (status) (rate(pdserve:proxy_requests_total{RATE}))"]),
    ("Proxy: legs in flight per backend", ["sum by (url) (pdserve:proxy_outstanding_requests)"]),
    ("Proxy: backends in rotation", ["sum by (role) (pdserve:proxy_backend_healthy)"]),
]


def panel(pid: int, title: str, exprs: list[str], x: int, y: int) -> dict:
    return {"id": pid, "type": "timeseries", "title": title,
            "datasource": {"type": "prometheus", "uid": "${DS_PROMETHEUS}"},
            "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
            "targets": [{"refId": chr(65 + i), "expr": e,
                         "datasource": {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}}
                        for i, e in enumerate(exprs)]}


def dashboard() -> dict:
    panels, y, pid = [], 0, 1
    for row_title, rows in (("Serving (vLLM's series)", SERVING),
                            ("P/D transfer and proxy", PD)):
        panels.append({"id": pid, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y = pid + 1, y + 1
        for i, (title, exprs) in enumerate(rows):
            panels.append(panel(pid, title, exprs, 12 * (i % 2), y + 8 * (i // 2)))
            pid += 1
        y += 8 * ((len(rows) + 1) // 2)
    return {
        "title": "pdserve: serving and P/D transfer", "uid": "pdserve", "schemaVersion": 39,
        "editable": True, "time": {"from": "now-1h", "to": "now"}, "refresh": "10s",
        "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource",
                      "pluginId": "prometheus", "pluginName": "Prometheus"}],
        "templating": {"list": [{
            "name": "model_name", "type": "query", "label": "Model",
            "datasource": {"type": "prometheus", "uid": "${DS_PROMETHEUS}"},
            "query": "label_values(vllm:num_requests_running, model_name)",
            "includeAll": True, "multi": True, "refresh": 2}]},
        "panels": panels,
    }


if __name__ == "__main__":
    out = pathlib.Path(__file__).with_name("pdserve.json")
    out.write_text(json.dumps(dashboard(), indent=1) + "\n")
    print(f"wrote {out}")
