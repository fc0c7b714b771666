"""Membership from etcd: the pools follow the engines registered under /pdserve/<cluster>/.

One task per proxy (`Membership.start`): read the prefix, make the pools match, then apply
the watch's changes as they come. A record is judged by `cluster.registration.decode`
(malformed, foreign, unsigned or badly signed records are counted in
`pdserve:proxy_discovery_rejected_total{reason}` and ignored), then its KV side channels must
accept a TCP connection (else `reason="unreachable_side_channel"`: it never gets traffic). An
admitted engine enters its pool out of rotation and is health-checked at once, so it takes
requests within one health check of registering; a deleted record (lease lapsed or revoked)
leaves the pool at once. While etcd is unreachable the pools stay as last seen (health checks
still take dead engines out of rotation) and the loop retries with backoff; losing etcd and
getting it back are logged once each, and a reconnect watches again from the last revision
applied (replaying what changed meanwhile; a compacted revision or a replaced etcd makes it
read the prefix again). A watch is bounded: etcd must create it within the call timeout,
and one that stays silent for `--etcd-watch-idle` seconds (a quiet prefix, a frozen etcd, a
half-open connection after a partition) is created again, so a dead path is noticed within
idle + timeout seconds instead of never.
Runs on the proxy's event loop; no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from prometheus_client import Counter, Gauge

from cluster.etcd import EtcdClient, EtcdError, EtcdTarget, WatchCompacted, WatchSilent
from cluster.registration import Registration, Rejected, cluster_prefix, decode
from proxy.backends import DECODE, PREFILL, BackendPool, HealthMonitor
from proxy.config import ProxyConfig
from proxy.metrics import ProxyMetrics

logger = logging.getLogger("pdserve.proxy")

_POOLS_OF_ROLE = {"prefill": (PREFILL,), "decode": (DECODE,), "both": (PREFILL, DECODE)}
_MAX_BACKOFF_S = 2.0


class Membership:
    def __init__(self, target: EtcdTarget, *, cluster: str, secret: bytes | None,
                 pools: dict[str, BackendPool], health: HealthMonitor,
                 metrics: ProxyMetrics, timeout: float, watch_idle: float) -> None:
        self.target = target
        self.cluster = cluster
        self._secret = secret
        self._pools = pools
        self._health = health
        self._timeout = timeout
        self._watch_idle = watch_idle
        self._prefix = cluster_prefix(cluster)
        self.records: dict[bytes, Registration] = {}  # admitted, by etcd key
        self._refused: dict[bytes, bytes] = {}  # key -> the value refused (judged once)
        self._client: EtcdClient | None = None
        self._task: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()
        self._down = False
        r = metrics.registry
        self.rejected = Counter("pdserve:proxy_discovery_rejected",
                                "Registrations in etcd ignored, by reason (malformed, foreign, "
                                "unsigned, bad_signature, unreachable_side_channel).",
                                ["reason"], registry=r)
        self.members = Gauge("pdserve:proxy_discovery_members",
                             "Engines registered in etcd and admitted, by pool.", ["role"],
                             registry=r)
        self.etcd_up = Gauge("pdserve:proxy_discovery_etcd_up",
                             "1 while the proxy's watch on etcd is live, else 0 (routing "
                             "goes on over the last membership).", registry=r)

    async def start(self, first_sync_timeout: float) -> None:
        """Start watching; wait up to `first_sync_timeout` for the first listing (the proxy
        starts anyway when etcd is down, with empty pools)."""
        self._client = EtcdClient(self.target, timeout=self._timeout)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="proxy-etcd")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._synced.wait(), first_sync_timeout)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._client is not None:
            await self._client.aclose()

    async def _run(self) -> None:
        assert self._client is not None
        backoff = 0.05
        revision = 0  # every change up to it is applied; 0: read the prefix first
        while True:
            try:
                if not revision:
                    revision, kvs = await self._client.get_prefix(self._prefix)
                    await self._resync(dict(kvs))
                async for batch in self._client.watch_prefix(self._prefix, revision + 1,
                                                             idle=self._watch_idle):
                    self._up()  # the first batch says the watch is live
                    backoff = 0.05
                    latest: dict[bytes, bytes | None] = {}  # replays keep each key's last
                    for ev in batch.events:
                        latest[ev.key] = None if ev.deleted else ev.value
                    for key, value in latest.items():
                        if value is None:
                            self._forget(key)
                        else:
                            await self._judge(key, value)
                    if latest:
                        self._sync_pools()
                    revision = batch.synced
            except WatchCompacted:
                revision = 0
            except WatchSilent:
                pass  # a quiet prefix, or a frozen etcd: watching again tells them apart
            except EtcdError as exc:
                self.etcd_up.set(0)
                if not self._down:
                    self._down = True
                    logger.warning("etcd %s unreachable (%s): routing over the last "
                                   "membership (%s)", self.target.display, exc, self._summary())
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF_S)

    def _up(self) -> None:
        self.etcd_up.set(1)
        self._synced.set()
        if self._down:
            self._down = False
            logger.warning("etcd %s answers again: watching on from the last revision "
                           "applied (%s)", self.target.display, self._summary())

    async def _resync(self, kvs: dict[bytes, bytes]) -> None:
        for key in [k for k in self.records if k not in kvs]:
            self._forget(key)
        for key in [k for k in self._refused if k not in kvs]:
            del self._refused[key]
        for key, value in kvs.items():
            if self._refused.get(key) != value:
                await self._judge(key, value)
        self._sync_pools()

    async def _judge(self, key: bytes, value: bytes) -> None:
        self._refused.pop(key, None)
        try:
            reg = decode(key, value, cluster=self.cluster, secret=self._secret)
            await self._probe(key, reg)
        except Rejected as exc:
            self.records.pop(key, None)
            self._refused[key] = value
            self.rejected.labels(reason=exc.reason).inc()
            logger.warning("etcd registration ignored (%s): %s", exc.reason, exc)
            return
        self.records[key] = reg

    async def _probe(self, key: bytes, reg: Registration) -> None:
        """Every KV side channel of the record accepts a connection, or Rejected."""
        for host, port in reg.kv_endpoints():
            try:
                _, writer = await asyncio.wait_for(
                    asyncio.open_connection(host.strip("[]"), port), self._timeout)
            except (OSError, asyncio.TimeoutError) as exc:
                raise Rejected("unreachable_side_channel",
                               f"{key.decode()}: {reg.url} names side channel {host}:{port}, "
                               f"which refuses connections ({type(exc).__name__})") from None
            writer.close()

    def _forget(self, key: bytes) -> None:
        self.records.pop(key, None)
        self._refused.pop(key, None)

    def _sync_pools(self) -> None:
        """Make each pool hold exactly the URLs the admitted records name."""
        wanted: dict[str, set[str]] = {role: set() for role in self._pools}
        for reg in self.records.values():
            for role in _POOLS_OF_ROLE[reg.role]:
                wanted[role].add(reg.url)
        for role, pool in self._pools.items():
            for b in [b for b in pool.backends if b.url not in wanted[role]]:
                pool.remove(b.url, "registration gone from etcd")
                logger.info("%s backend %s left the cluster", role, b.url)
            for url in sorted(wanted[role]):
                backend = pool.add(url)
                if backend is not None:
                    logger.info("%s backend %s joined the cluster", role, url)
                    self._health.recheck(pool, backend)
            self.members.labels(role=role).set(len(pool.backends))

    def _summary(self) -> str:
        return ", ".join(f"{len(p.backends)} {role}" for role, p in self._pools.items())


def start_membership(config: ProxyConfig, prefill: BackendPool, decode_pool: BackendPool,
                     health: HealthMonitor, metrics: ProxyMetrics) -> Membership:
    """The Membership of `config.discovery` (not started yet)."""
    assert config.discovery
    target = EtcdTarget.parse(config.discovery, ca=config.etcd_ca, cert=config.etcd_cert,
                              key=config.etcd_key)
    secret = config.registration_secret.encode() if config.registration_secret else None
    return Membership(target, cluster=config.cluster, secret=secret,
                      pools={PREFILL: prefill, DECODE: decode_pool}, health=health,
                      metrics=metrics, timeout=config.health_timeout,
                      watch_idle=config.etcd_watch_idle)
