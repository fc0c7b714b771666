"""P's KV coordinates (`GET /kv_transfer/info`), cached per P URL.

The cache entry of a P is dropped whenever that P enters or leaves rotation or one of its
legs fails, so a restarted P (new engine id, new side-channel port) is always re-read.
Concurrent lookups of one URL share a single fetch.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx


class KVInfoError(Exception):
    """P's coordinates could not be read; the message names the P URL."""


@dataclass(frozen=True)
class PrefillCoordinates:
    engine_id: str
    kv_host: str
    kv_port: int
    tp_size: int
    block_size: int | None = None
    kv_role: str | None = None
    kv_connector: str | None = None

    @classmethod
    def from_json(cls, data: Any, url: str) -> PrefillCoordinates:
        if not isinstance(data, dict):
            raise KVInfoError(f"prefill backend {url}: /kv_transfer/info is not a JSON object")
        try:
            engine_id, kv_host = data["engine_id"], data["kv_host"]
            kv_port, tp_size = data["kv_port"], data["tp_size"]
        except KeyError as exc:
            raise KVInfoError(
                f"prefill backend {url}: /kv_transfer/info lacks {exc.args[0]!r}") from None
        if not (isinstance(engine_id, str) and engine_id and isinstance(kv_host, str) and kv_host):
            raise KVInfoError(f"prefill backend {url}: bad engine_id/kv_host in /kv_transfer/info")
        for name, value in (("kv_port", kv_port), ("tp_size", tp_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise KVInfoError(f"prefill backend {url}: bad {name}={value!r}")
        block_size = data.get("block_size")
        return cls(
            engine_id=engine_id,
            kv_host=kv_host,
            kv_port=kv_port,
            tp_size=tp_size,
            block_size=block_size if isinstance(block_size, int) else None,
            kv_role=data.get("kv_role"),
            kv_connector=data.get("kv_connector"),
        )


class KVInfoCache:
    def __init__(
        self, client: httpx.AsyncClient, *, timeout: float, headers: dict[str, str] | None = None
    ) -> None:
        self._client = client
        self._timeout = timeout
        self._headers = headers or {}
        self._entries: dict[str, asyncio.Future[PrefillCoordinates]] = {}

    async def get(self, url: str) -> PrefillCoordinates:
        fut = self._entries.get(url)
        if fut is None or (fut.done() and (fut.cancelled() or fut.exception() is not None)):
            fut = asyncio.ensure_future(self._fetch(url))
            self._entries[url] = fut
        try:
            # shield: one waiter giving up must not cancel the fetch the others share
            return await asyncio.shield(fut)
        except KVInfoError:
            if self._entries.get(url) is fut:
                del self._entries[url]
            raise

    def invalidate(self, url: str) -> None:
        self._entries.pop(url, None)

    async def _fetch(self, url: str) -> PrefillCoordinates:
        try:
            resp = await self._client.get(
                url + "/kv_transfer/info", headers=self._headers, timeout=self._timeout
            )
        except httpx.HTTPError as exc:
            raise KVInfoError(
                f"prefill backend {url}: /kv_transfer/info failed: {type(exc).__name__}: {exc}"
            ) from exc
        if resp.status_code != 200:
            raise KVInfoError(
                f"prefill backend {url}: /kv_transfer/info answered {resp.status_code}")
        try:
            data = resp.json()
        except ValueError:
            raise KVInfoError(f"prefill backend {url}: /kv_transfer/info is not JSON") from None
        return PrefillCoordinates.from_json(data, url)
