"""Prometheus metrics of the proxy. Every name starts with `pdserve:proxy_`.

Each app owns its registry, so several proxies in one process (tests) never collide.
Only the event-loop thread updates them.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

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

# the proxy's own share of a first byte: sub-millisecond when all is well
_HOP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                0.5, 1.0)

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

        self.hop = Histogram(
            "pdserve:proxy_hop_seconds",
            "The proxy's own time on a request's path to the client's first byte, by part: "
            "dispatch (the request's arrival to its first leg sent) and relay (the backend "
            "chunk that becomes the client's first byte received to that byte sent).",
            ["part"], buckets=_HOP_BUCKETS, registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


# ---- the proxy hop (pdserve:proxy_hop_seconds) ---------------------------------------------
@dataclass
class HopClock:
    """One request's marks (monotonic seconds), set from its task and the leg tasks it spawns
    (they inherit the context, hence this object)."""

    arrived: float
    leg_sent: float | None = None  # the first leg's request about to leave
    backend_byte: float | None = None  # the latest first chunk of a leg before the client's
    client_byte: float | None = None


_HOP: ContextVar[HopClock | None] = ContextVar("pdserve_proxy_hop", default=None)


def mark_leg_sent() -> None:
    """A leg's request is about to leave for a backend (legs.py): the first one counts."""
    hop = _HOP.get()
    if hop is not None and hop.leg_sent is None:
        hop.leg_sent = time.monotonic()


def hop_clock() -> HopClock | None:
    """The current request's clock, for a callback that runs outside its context (a
    protocol's data_received: proxy/leg_client.py)."""
    return _HOP.get()


def mark_backend_byte(hop: HopClock | None = None) -> None:
    """A leg's first body bytes arrived (P's answer, P's streamed head, D's first chunk); the
    latest such mark before the client's first byte is the chunk that became it. `hop`: the
    request's clock (default: the current context's)."""
    hop = hop or _HOP.get()
    if hop is not None and hop.client_byte is None:
        hop.backend_byte = time.monotonic()


class HopMiddleware:
    """ASGI middleware: gives each HTTP request a HopClock and observes the proxy hop when the
    first non-empty body message goes to the client (requests that sent no leg: none)."""

    def __init__(self, app: Any, metrics: ProxyMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        hop = HopClock(time.monotonic())
        token = _HOP.set(hop)

        async def sending(message: Any) -> None:
            await send(message)
            if (hop.client_byte is None and message["type"] == "http.response.body"
                    and message.get("body")):
                hop.client_byte = time.monotonic()
                self._observe(hop)

        try:
            await self.app(scope, receive, sending)
        finally:
            _HOP.reset(token)

    def _observe(self, hop: HopClock) -> None:
        if hop.leg_sent is None or hop.backend_byte is None or hop.client_byte is None:
            return
        self.metrics.hop.labels(part="dispatch").observe(hop.leg_sent - hop.arrived)
        self.metrics.hop.labels(part="relay").observe(hop.client_byte - hop.backend_byte)
