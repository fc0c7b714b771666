"""P's KV coordinates (`GET /kv_transfer/info`), cached per P URL.

The cache entry of a P is dropped whenever that P enters or leaves rotation or one of its
legs fails, so a restarted P (new engine id, new side-channel port) is always re-read.
Concurrent lookups of one URL share a single fetch.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace
from typing import Any

import httpx

logger = logging.getLogger("pdserve.proxy")


class KVInfoError(Exception):
    """P's coordinates could not be read; the message names the P URL."""


@dataclass(frozen=True)
class RankCoordinates:
    """One data-parallel rank of a prefill server: its own engine id and side channel."""

    rank: int
    engine_id: str
    kv_host: str
    kv_port: int
    alive: bool = True


@dataclass(frozen=True)
class PrefillCoordinates:
    engine_id: str
    kv_host: str
    kv_port: int
    tp_size: int
    block_size: int | None = None
    kv_role: str | None = None
    kv_connector: str | None = None
    ranks: tuple[RankCoordinates, ...] = ()  # empty: not data parallel (no rank to name)

    @property
    def live_ranks(self) -> list[int]:
        return [r.rank for r in self.ranks if r.alive]

    def for_rank(self, rank: int) -> PrefillCoordinates:
        """These coordinates with rank `rank`'s engine id and side channel."""
        r = next(r for r in self.ranks if r.rank == rank)
        return replace(self, engine_id=r.engine_id, kv_host=r.kv_host, kv_port=r.kv_port)

    @classmethod
    def from_json(cls, data: Any, url: str) -> PrefillCoordinates:
        if not isinstance(data, dict):
            raise KVInfoError(f"prefill backend {url}: /kv_transfer/info is not a JSON object")
        engine_id, kv_host, kv_port = _address(data, url, "")
        tp_size = _field(data, url, "", "tp_size")
        _check_int(url, "tp_size", tp_size)
        block_size = data.get("block_size")
        return cls(
            engine_id=engine_id,
            kv_host=kv_host,
            kv_port=kv_port,
            tp_size=tp_size,
            block_size=block_size if isinstance(block_size, int) else None,
            kv_role=data.get("kv_role"),
            kv_connector=data.get("kv_connector"),
            ranks=_ranks(data.get("data_parallel_ranks"), url),
        )


def _field(data: dict[str, Any], url: str, where: str, name: str) -> Any:
    try:
        return data[name]
    except KeyError:
        raise KVInfoError(
            f"prefill backend {url}: /kv_transfer/info{where} lacks {name!r}") from None


def _check_int(url: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise KVInfoError(f"prefill backend {url}: bad {name}={value!r}")


def _address(data: dict[str, Any], url: str, where: str) -> tuple[str, str, int]:
    engine_id, kv_host, kv_port = (_field(data, url, where, n)
                                   for n in ("engine_id", "kv_host", "kv_port"))
    if not (isinstance(engine_id, str) and engine_id and isinstance(kv_host, str) and kv_host):
        raise KVInfoError(
            f"prefill backend {url}: bad engine_id/kv_host in /kv_transfer/info{where}")
    _check_int(url, "kv_port", kv_port)
    return engine_id, kv_host, kv_port


def _ranks(listed: Any, url: str) -> tuple[RankCoordinates, ...]:
    """`data_parallel_ranks` of a data-parallel server (absent: none)."""
    if listed is None:
        return ()
    if not isinstance(listed, list) or not all(isinstance(r, dict) for r in listed):
        raise KVInfoError(f"prefill backend {url}: data_parallel_ranks is not a list of objects")
    ranks = []
    for i, r in enumerate(listed):
        where = f".data_parallel_ranks[{i}]"
        rank = _field(r, url, where, "rank")
        _check_int(url, "rank", rank)
        ranks.append(RankCoordinates(rank, *_address(r, url, where),
                                     alive=r.get("alive", True) is not False))
    return tuple(ranks)


class KVInfoCache:
    def __init__(
        self, client: httpx.AsyncClient, *, timeout: float, headers: dict[str, str] | None = None
    ) -> None:
        self._client = client
        self._timeout = timeout
        self._headers = headers or {}
        self._entries: dict[str, asyncio.Future[PrefillCoordinates]] = {}
        self._absent: set[str] = set()  # URLs get_optional found without usable info

    def cached(self, url: str) -> PrefillCoordinates | None:
        """`url`'s coordinates when already fetched (no task, no wait: every request's hot
        path), else None: then `get`."""
        fut = self._entries.get(url)
        if fut is None or not fut.done() or fut.cancelled() or fut.exception() is not None:
            return None
        return fut.result()

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

    async def get_optional(self, url: str) -> PrefillCoordinates | None:
        """For pull mode, where P's answer names its side channel and the info only tells
        the data-parallel ranks: None when P serves no usable /kv_transfer/info (remembered
        until `invalidate`, so such a P costs one lookup, not one per request)."""
        if url in self._absent:
            return None
        try:
            return await self.get(url)
        except KVInfoError as exc:
            self._absent.add(url)
            logger.info("%s; its legs name no data-parallel rank", exc)
            return None

    def invalidate(self, url: str) -> None:
        self._entries.pop(url, None)
        self._absent.discard(url)

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
