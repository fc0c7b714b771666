"""Retry on another pair: a request whose P or D leg fails before the client got a byte is
sent again, with a fresh engine request id and (push) a fresh transfer id.

Invariants
  - Only before the relay starts (`RequestContext.retry_open`, cleared by the relay): once the
    client has a byte, a failure is the relay's (error event, or migration) - never a retry.
  - Bounded: at most `retries` further attempts; the last attempt's failure goes to the
    existing policy (--p-failure-policy for P, an error for D).
  - A failed attempt's legs are cancelled before the next starts (the dispatcher's waits
    cancel the other leg on every exception, which aborts it on its engine and frees its
    blocks); a backend that refused the connection is out of rotation already
    (`BackendPool.record_failure`), so the next route avoids it.
  - Retryable: a D that refused, broke off or answered 5xx before its first chunk
    (`decode_failed`); a P leg that failed on the server side (refused, reset, 5xx, died
    before any WRITE). Client errors (4xx), timeouts (the request deadline) and "no healthy
    backend" are not.
Counted in `pdserve:proxy_retries_total{role,reason}`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from prometheus_client import Counter, Histogram
from starlette.responses import Response

from proxy.errors import ProxyError
from proxy.legs import new_id
from proxy.metrics import ProxyMetrics

logger = logging.getLogger("pdserve.proxy")

_RETRYABLE_CODES = ("decode_failed",)


class RetryPair(Exception):
    """A leg failed before the client got a byte and another pair may take the request."""

    def __init__(self, role: str, url: str, reason: str) -> None:
        super().__init__(f"{role} backend {url} {reason}")
        self.role, self.url, self.reason = role, url, reason


class Retryable(Protocol):
    request_id: str
    engine_request_id: str
    headers: dict[str, str]
    retry_open: bool


class RetryPolicy:
    def __init__(self, retries: int, metrics: ProxyMetrics) -> None:
        self.retries = retries
        self.counter = Counter("pdserve:proxy_retries",
                               "Requests sent to another pair before the client got a byte, "
                               "by the role and reason of the failed leg.", ["role", "reason"],
                               registry=metrics.registry)
        self.attempts = Histogram("pdserve:proxy_request_attempts",
                                  "Pairs tried per request that reached the relay or failed.",
                                  buckets=(1, 2, 3, 4, 5, 8), registry=metrics.registry)

    async def run(self, ctx: Retryable, attempt: Callable[[], Awaitable[Response]]
                  ) -> Response:
        n = 0
        while True:
            n += 1
            ctx.retry_open = n <= self.retries
            try:
                response = await attempt()
            except RetryPair as failed:
                self._again(ctx, failed.role, failed.reason, str(failed), n)
                continue
            except ProxyError as error:
                if not (ctx.retry_open and error.code in _RETRYABLE_CODES):
                    self.attempts.observe(n)
                    raise
                self._again(ctx, "decode", error.code or "", error.message, n)
                continue
            self.attempts.observe(n)
            return response

    def _again(self, ctx: Retryable, role: str, reason: str, detail: str, n: int) -> None:
        self.counter.labels(role=role, reason=reason).inc()
        ctx.engine_request_id = new_id()  # never reuse an id an engine may still hold
        ctx.headers["x-request-id"] = ctx.engine_request_id
        logger.warning("request %s: attempt %d failed before the first byte (%s); "
                       "trying another pair", ctx.request_id, n, detail)
