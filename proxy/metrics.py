"""Prometheus metrics of the proxy. Every name starts with `pdserve:proxy_`.

Each app owns its registry, so several proxies in one process (tests) never collide.
Only the event-loop thread updates them.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0,
)

# end-to-end: vLLM's request-latency buckets (to 7680 s), not the first-byte ones above
_REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ProxyMetrics:
    """Contract names: requests_total{route,status}, backend_healthy{url,role}, ttft_seconds,
    outstanding_requests{url}. The rest are extra detail under the same prefix."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "pdserve:proxy_requests", "Client requests by route and HTTP status sent.",
            ["route", "status"], registry=r,
        )
        self.backend_healthy = Gauge(
            "pdserve:proxy_backend_healthy", "1 if the backend is in rotation, else 0.",
            ["url", "role"], registry=r,
        )
        self.ttft = Histogram(
            "pdserve:proxy_ttft_seconds",
            "Time from the client request to the first response byte relayed from D.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "pdserve:proxy_e2e_request_latency_seconds",
            "Time from the client request to the end of the relayed response.",
            buckets=_REQUEST_BUCKETS, registry=r,
        )
        self.outstanding = Gauge(
            "pdserve:proxy_outstanding_requests", "Legs in flight to the backend.",
            ["url"], registry=r,
        )
        self.backend_failures = Counter(
            "pdserve:proxy_backend_failures",
            "Failed legs and health checks by backend and reason.",
            ["url", "role", "reason"], registry=r,
        )
        self.backend_rechecks = Counter(
            "pdserve:proxy_backend_rechecks",
            "Immediate health checks after a leg failed once the backend had the request, "
            "by outcome (healthy: the backend stays in rotation; unhealthy: it leaves).",
            ["url", "role", "outcome"], registry=r,
        )
        self.prefill_failures = Counter(
            "pdserve:proxy_prefill_leg_failures",
            "Failed P legs by the action the p-failure-policy took.",
            ["action"], registry=r,
        )
        self.stream_aborts = Counter(
            "pdserve:proxy_stream_aborts",
            "Relays that ended early, by reason (client_disconnect, prefill_failed, "
            "decode_failed, timeout).",
            ["reason"], registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
