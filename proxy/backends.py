"""Backend pools: health state, outstanding-leg counts, least-outstanding choice, health polling.

Threading: everything here runs on the proxy's event loop; no locks. A backend is in rotation
iff `healthy`. It leaves rotation when a health check fails or a leg cannot connect to it, and
returns only through a passing health check. A leg that fails once the backend has the request
(a 5xx, a reset, a timeout) may have failed because of the request itself, and no request may
take a healthy backend out of rotation: such a failure is counted and triggers an immediate
health check (`HealthMonitor.recheck`), whose verdict decides.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import httpx

from proxy.metrics import ProxyMetrics

logger = logging.getLogger("pdserve.proxy")

PREFILL = "prefill"
DECODE = "decode"


@dataclass(eq=False)
class Backend:
    url: str
    role: str
    healthy: bool = False
    outstanding: int = 0
    last_error: str = "not checked yet"
    pending_tokens: int = 0  # prompt tokens of the legs in flight (proxy/routing.py)
    # a decode backend's load as its last health poll read it (/metrics); None: unknown
    free_kv_blocks: int | None = None
    running_requests: int | None = None
    load_read_at: float = float("-inf")  # monotonic time of that read
    # data-parallel prefill servers: outstanding legs per rank, and where ties start
    rank_outstanding: dict[int, int] = field(default_factory=dict)
    rank_cursor: int = 0


class Lease:
    """One leg's claim on a backend; `release()` is idempotent so every exit path may call it."""

    __slots__ = ("backend", "pool", "rank", "tokens", "_released")

    def __init__(self, pool: BackendPool, backend: Backend, tokens: int = 0) -> None:
        self.backend = backend
        self.pool = pool
        self.rank: int | None = None  # the data-parallel rank the leg is pinned to
        self.tokens = tokens  # counted in backend.pending_tokens until released
        self._released = False

    @property
    def url(self) -> str:
        return self.backend.url

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.backend.pending_tokens -= self.tokens
            self.pool._release(self.backend, self.rank)

    def pin_rank(self, ranks: Sequence[int]) -> int:
        """Pin this leg to the rank of `ranks` (not empty) with the fewest outstanding legs
        on this backend; ties go round-robin. Released with the lease."""
        assert self.rank is None and not self._released, "rank pinned twice or after release"
        b, order = self.backend, sorted(ranks)
        start = next((i for i, r in enumerate(order) if r >= b.rank_cursor), 0)
        order = order[start:] + order[:start]
        rank = min(order, key=lambda r: b.rank_outstanding.get(r, 0))
        b.rank_cursor = rank + 1
        b.rank_outstanding[rank] = b.rank_outstanding.get(rank, 0) + 1
        self.rank = rank
        return rank


class BackendPool:
    """All backends of one role."""

    def __init__(self, role: str, urls: Iterable[str], metrics: ProxyMetrics) -> None:
        self.role = role
        self.backends = [Backend(url, role) for url in urls]
        self._metrics = metrics
        self._cursor = 0
        self._on_transition: list[Callable[[Backend], None]] = []
        self._on_suspect: list[Callable[[BackendPool, Backend], None]] = []
        for b in self.backends:
            metrics.backend_healthy.labels(url=b.url, role=role).set(0)
            metrics.outstanding.labels(url=b.url).set(0)

    def on_transition(self, callback: Callable[[Backend], None]) -> None:
        """Call `callback(backend)` whenever a backend enters or leaves rotation."""
        self._on_transition.append(callback)

    def on_suspect(self, callback: Callable[[BackendPool, Backend], None]) -> None:
        """Call `callback(pool, backend)` when a leg failed after reaching `backend`."""
        self._on_suspect.append(callback)

    @property
    def metrics(self) -> ProxyMetrics:
        return self._metrics

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    def choose(self, exclude: Iterable[Backend] = ()) -> Lease | None:
        """Lease the healthy backend with the fewest outstanding legs (None if there is none).

        Ties go round-robin, so idle backends share the load evenly.
        """
        skip = set(map(id, exclude))
        n = len(self.backends)
        best: Backend | None = None
        for i in range(n):
            b = self.backends[(self._cursor + i) % n]
            if not b.healthy or id(b) in skip:
                continue
            if best is None or b.outstanding < best.outstanding:
                best = b
        if best is None:
            return None
        return self.lease(best)

    def lease(self, backend: Backend, tokens: int = 0) -> Lease:
        """Lease `backend` (a routing policy chose it); ties of later choices start after it.
        `tokens`: the leg's prompt tokens still to compute, counted in `pending_tokens`."""
        self._cursor = (self.backends.index(backend) + 1) % len(self.backends)
        backend.outstanding += 1
        backend.pending_tokens += tokens
        self._metrics.outstanding.labels(url=backend.url).set(backend.outstanding)
        return Lease(self, backend, tokens)

    @property
    def cursor(self) -> int:
        """Where ties start: the backend after the last one leased (round-robin)."""
        return self._cursor

    def _release(self, backend: Backend, rank: int | None = None) -> None:
        if rank is not None:
            backend.rank_outstanding[rank] -= 1
        backend.outstanding -= 1
        assert backend.outstanding >= 0, f"outstanding count of {backend.url} went negative"
        self._metrics.outstanding.labels(url=backend.url).set(backend.outstanding)

    def set_health(self, backend: Backend, healthy: bool, reason: str = "") -> None:
        if healthy:
            backend.last_error = ""
        else:
            backend.last_error = reason
        if backend.healthy == healthy:
            return
        backend.healthy = healthy
        self._metrics.backend_healthy.labels(url=backend.url, role=self.role).set(int(healthy))
        if healthy:
            logger.info("%s backend %s in rotation", self.role, backend.url)
        else:
            logger.warning("%s backend %s out of rotation: %s", self.role, backend.url, reason)
        for callback in self._on_transition:
            callback(backend)

    def record_failure(self, backend: Backend, reason: str, *, unreachable: bool) -> None:
        """Count a failed leg in `backend_failures_total{reason}`.

        `unreachable` (no connection could be made, or P's kv info could not be read: no
        client input touches either) takes the backend out at once. Any other failure came
        after the backend had the request, which may have caused it: the backend is only
        suspected, and an immediate health check decides."""
        self._metrics.backend_failures.labels(url=backend.url, role=self.role, reason=reason).inc()
        if unreachable:
            self.set_health(backend, False, reason)
            return
        for callback in self._on_suspect:
            callback(self, backend)

    def health_result(self, backend: Backend, ok: bool, reason: str = "") -> None:
        """Apply one health-check outcome; a failing check on a backend in rotation is counted."""
        if not ok and backend.healthy:
            self._metrics.backend_failures.labels(
                url=backend.url, role=self.role, reason="health_check").inc()
        self.set_health(backend, ok, reason)

    def add(self, url: str) -> Backend | None:
        """Put a backend into the pool, out of rotation until its first health check passes
        (membership: proxy/discovery.py). None if the pool has it already."""
        if any(b.url == url for b in self.backends):
            return None
        backend = Backend(url, self.role)
        self.backends.append(backend)
        self._metrics.backend_healthy.labels(url=url, role=self.role).set(0)
        self._metrics.outstanding.labels(url=url).set(0)
        return backend

    def remove(self, url: str, reason: str) -> None:
        """Take a backend out of the pool (its registration is gone); legs in flight keep
        their leases, whose release still balances its counts."""
        backend = next((b for b in self.backends if b.url == url), None)
        if backend is None:
            return
        self.set_health(backend, False, reason)
        self.backends.remove(backend)
        self._cursor = 0


_LOAD_GAUGES = {"pdserve:num_free_kv_blocks": 0, "pdserve:num_requests_running": 1}
# A decode backend's /metrics costs it a render and a stats round-trip to its engine core:
# read at most this often, whatever the health interval (an idle D stays idle)
LOAD_POLL_INTERVAL_S = 5.0


def parse_load(text: str) -> tuple[int | None, int | None]:
    """(free KV blocks, running requests) from an engine's Prometheus text, summed over its
    data-parallel ranks; None for a gauge missing or malformed."""
    found: list[float | None] = [None, None]
    for line in text.splitlines():
        i = _LOAD_GAUGES.get(line.split("{", 1)[0].split(" ", 1)[0])
        if i is None:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            return None, None
        if not 0 <= value < 2**53:
            return None, None
        found[i] = (found[i] or 0) + value
    return tuple(None if v is None else int(v) for v in found)  # type: ignore[return-value]


class HealthMonitor:
    """Polls `GET /health` of every backend every `interval` seconds; 200 means in rotation."""

    def __init__(
        self,
        pools: Iterable[BackendPool],
        client: httpx.AsyncClient,
        *,
        interval: float,
        timeout: float,
        headers: dict[str, str] | None = None,
    ) -> None:
        self._pools = list(pools)
        self._client = client
        self._interval = interval
        self._timeout = timeout
        self._headers = headers or {}
        self._task: asyncio.Task[None] | None = None
        self._rechecks: dict[str, asyncio.Task[None]] = {}  # backend URL -> its recheck
        for pool in self._pools:
            pool.on_suspect(self.recheck)

    async def check_once(self) -> None:
        checks = [self._check(pool, b) for pool in self._pools for b in pool.backends]
        await asyncio.gather(*checks)

    def recheck(self, pool: BackendPool, backend: Backend) -> None:
        """Check `backend` now, once a leg to it failed after reaching it; at most one such
        check per backend at a time, so failing requests cannot flood it with checks.
        Counted in `backend_rechecks_total{outcome}`."""
        running = self._rechecks.get(backend.url)
        if running is not None and not running.done():
            return
        self._rechecks[backend.url] = asyncio.get_running_loop().create_task(
            self._recheck(pool, backend), name="proxy-recheck")

    async def _recheck(self, pool: BackendPool, backend: Backend) -> None:
        ok = await self._check(pool, backend)
        pool.metrics.backend_rechecks.labels(url=backend.url, role=pool.role,
                                             outcome="healthy" if ok else "unhealthy").inc()

    async def _check(self, pool: BackendPool, backend: Backend) -> bool:
        try:
            resp = await self._client.get(
                backend.url + "/health", headers=self._headers, timeout=self._timeout
            )
        except httpx.HTTPError as exc:
            pool.health_result(backend, False, f"health check failed: {type(exc).__name__}: {exc}")
            return False
        ok = resp.status_code == 200
        pool.health_result(backend, ok, "" if ok else f"health check answered {resp.status_code}")
        if pool.role == DECODE:
            await self._poll_load(backend, ok)
        return ok

    async def _poll_load(self, backend: Backend, healthy: bool) -> None:
        """A decode backend's free KV blocks and running requests (its /metrics gauges, no
        engine round-trip), for the kv-aware policy; unknown (None) when unreadable."""
        now = time.monotonic()
        if healthy and now - backend.load_read_at < LOAD_POLL_INTERVAL_S:
            return  # the last read stands
        backend.load_read_at = now
        load: tuple[int | None, int | None] = (None, None)
        if healthy:
            try:
                resp = await self._client.get(backend.url + "/metrics", headers=self._headers,
                                              timeout=self._timeout)
                if resp.status_code == 200:
                    load = parse_load(resp.text)
            except httpx.HTTPError:
                pass
        backend.free_kv_blocks, backend.running_requests = load

    def start(self) -> None:
        assert self._task is None, "health monitor started twice"
        self._task = asyncio.get_running_loop().create_task(self._run(), name="proxy-health")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.check_once()
            except Exception:  # never let one bad round stop the polling
                logger.exception("health check round failed")

    async def stop(self) -> None:
        rechecks = [t for t in self._rechecks.values() if not t.done()]
        for task in rechecks:
            task.cancel()
        await asyncio.gather(*rechecks, return_exceptions=True)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
