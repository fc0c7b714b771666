"""Engine side: keep this server's registration alive in etcd while it serves.

A server companion (engine/server/cli.py calls `start()` once the server listens and `stop()`
first thing on SIGTERM/SIGINT, before draining). It reads the server's own
/kv_transfer/info over HTTP (so it needs nothing of the engine's insides), puts the record
under a fresh lease with a short TTL and refreshes the lease every TTL/3. etcd unreachable:
logged once, the server keeps serving, the lease is refreshed (or, once lapsed, granted
again and the record rewritten) as soon as etcd answers - also logged once. `stop()`
revokes the lease, so the record is gone before the server drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx

from cluster.etcd import EtcdClient, EtcdError, EtcdTarget
from cluster.registration import Registration, engine_key

logger = logging.getLogger("pdserve.cluster")

_STOP_TIMEOUT_S = 1.0


class Registrar:
    def __init__(self, target: EtcdTarget, *, cluster: str, role: str, url: str, model: str,
                 local_url: str, api_key: str | None, secret: bytes | None, ttl: int) -> None:
        if ttl < 1:
            raise ValueError(f"--discovery-ttl must be >= 1 s, got {ttl}")
        self.target = target
        self.cluster, self.role, self.url, self.model = cluster, role, url, model
        self._local_url = local_url
        self._api_key = api_key
        self._secret = secret
        self.ttl = ttl
        self.lease: int | None = None
        self._down = False
        self._client: EtcdClient | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._client = EtcdClient(self.target, timeout=max(0.5, self.ttl / 3))
        self._task = asyncio.get_running_loop().create_task(self._run(), name="registrar")

    async def stop(self) -> None:
        """Deregister now (revoke the lease), bounded by a second; then stop refreshing."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._client is None:
            return
        if self.lease is not None:
            try:
                await asyncio.wait_for(self._client.revoke(self.lease), _STOP_TIMEOUT_S)
                logger.info("deregistered %s from etcd %s", self.url, self.target.display)
            except (EtcdError, asyncio.TimeoutError) as exc:
                logger.warning("could not deregister %s (its lease lapses within %d s): %s",
                               self.url, self.ttl, exc)
            self.lease = None
        client, self._client = self._client, None
        await client.aclose()

    async def _run(self) -> None:
        kv = await self._own_kv_info()
        reg = Registration(self.cluster, self.role, self.url, self.model, kv)
        backoff = 0.1
        while True:
            try:
                await self._register_or_refresh(reg)
                backoff = 0.1
                await asyncio.sleep(self.ttl / 3)
            except EtcdError as exc:
                if not self._down:
                    self._down = True
                    logger.warning("etcd %s unreachable (%s): still serving; registering "
                                   "again when it answers", self.target.display, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.ttl / 3)

    async def _register_or_refresh(self, reg: Registration) -> None:
        assert self._client is not None
        if self.lease is not None and await self._client.keepalive(self.lease) > 0:
            self._back()
            return
        lease = await self._client.grant(self.ttl)
        key = engine_key(self.cluster, lease)
        await self._client.put(key, reg.encode(key, self._secret), lease)
        self.lease = lease
        self._back()
        logger.info("registered %s (%s) in etcd %s as %s, ttl %d s", self.url, self.role,
                    self.target.display, key.decode(), self.ttl)

    def _back(self) -> None:
        if self._down:
            self._down = False
            logger.warning("etcd %s answers again: registration of %s refreshed",
                           self.target.display, self.url)

    async def _own_kv_info(self) -> dict | None:
        """This server's /kv_transfer/info (None when it has no KV connector)."""
        headers = {"authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        async with httpx.AsyncClient(trust_env=False, timeout=5.0) as client:
            while True:
                try:
                    resp = await client.get(self._local_url + "/kv_transfer/info",
                                            headers=headers)
                except httpx.HTTPError:
                    await asyncio.sleep(0.05)  # the server is just starting to accept
                    continue
                if resp.status_code == 200:
                    return resp.json()
                return None
