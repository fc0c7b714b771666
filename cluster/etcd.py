"""A small asyncio etcd v3 client over etcd's JSON gateway (`POST /v3/...`) and httpx.

Why the gateway: it ships with every etcd (3.4's Debian `etcd-server` included), speaks plain
HTTP/JSON through the HTTP client we already depend on, and needs no gRPC or protobuf stack
(the `etcd3` package breaks on current protobuf; `aetcd` pulls grpcio; `etcd3gw` is
synchronous). Only what membership needs: leases, put/delete, a prefix range and a prefix
watch. Keys and values are bytes on our side, base64 on the wire; int64 fields arrive as
strings. Every failure to reach or understand etcd is an `EtcdError`.

Targets: `etcd://HOST:PORT` (plain HTTP) or `etcds://HOST:PORT` (TLS, verified against
`ca`, optionally with a client certificate). `user:password@` in the URL (or the password in
$PDSERVE_ETCD_PASSWORD) turns on etcd's authentication: the client fetches a token from
/v3/auth/authenticate and sends it on every call, fetching a new one when etcd refuses it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import httpx

PASSWORD_ENV = "PDSERVE_ETCD_PASSWORD"


class EtcdError(Exception):
    """etcd could not be reached or answered something unusable; the message says which."""


class WatchCompacted(EtcdError):
    """The watch cannot go on from its start revision (compacted, or etcd's store is younger
    than it: a replaced etcd): read the prefix again."""


class WatchSilent(EtcdError):
    """A live watch sent nothing for its idle bound: watch again to prove the path."""


@dataclass(frozen=True)
class EtcdTarget:
    base_url: str  # http(s)://host:port
    user: str | None = None
    password: str | None = None
    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    @classmethod
    def parse(cls, url: str, *, ca: str | None = None, cert: str | None = None,
              key: str | None = None) -> EtcdTarget:
        """`etcd[s]://[user[:password]@]host:port`; anything else is a ValueError."""
        parts = urlsplit(str(url).strip())
        if parts.scheme not in ("etcd", "etcds") or not parts.hostname:
            raise ValueError(f"--discovery must look like etcd://HOST:PORT or "
                             f"etcds://HOST:PORT, got {url!r}")
        try:
            port = parts.port or 2379
        except ValueError:
            raise ValueError(f"--discovery has a bad port: {url!r}") from None
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(f"--discovery takes no path or query: {url!r}")
        if (cert is None) != (key is None):
            raise ValueError("--etcd-cert and --etcd-key go together")
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        scheme = "https" if parts.scheme == "etcds" else "http"
        user = unquote(parts.username) if parts.username else None
        password = unquote(parts.password) if parts.password else os.environ.get(PASSWORD_ENV)
        return cls(f"{scheme}://{host}:{port}", user, password if user else None, ca, cert, key)

    @property
    def display(self) -> str:
        """The URL without credentials, for logs."""
        return self.base_url


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: Any) -> bytes:
    if not isinstance(text, str):
        return b""
    return base64.b64decode(text)


def prefix_end(prefix: bytes) -> bytes:
    """The range end that makes [prefix, end) every key starting with `prefix`."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


@dataclass(frozen=True)
class WatchEvent:
    deleted: bool
    key: bytes
    value: bytes  # empty for a delete


@dataclass(frozen=True)
class WatchBatch:
    events: list[WatchEvent]
    synced: int  # every change up to this revision has been delivered: watch on from +1
    head: int  # etcd's revision when it sent the batch


class EtcdClient:
    """One connection pool to one etcd. Runs on one event loop; no locks."""

    def __init__(self, target: EtcdTarget, *, timeout: float = 2.0) -> None:
        self.target = target
        self._timeout = timeout
        verify: Any = True
        if target.base_url.startswith("https"):
            verify = ssl.create_default_context(cafile=target.ca)
            if target.cert:
                verify.load_cert_chain(target.cert, target.key)
        self._http = httpx.AsyncClient(base_url=target.base_url, verify=verify,
                                       timeout=httpx.Timeout(timeout), trust_env=False)
        self._token: str | None = None

    async def aclose(self) -> None:
        await self._http.aclose()

    # ---- calls ------------------------------------------------------------------------------

    async def grant(self, ttl: int) -> int:
        out = await self._call("/v3/lease/grant", {"TTL": ttl})
        return _int(out, "ID")

    async def keepalive(self, lease: int) -> int:
        """The lease's remaining TTL after refreshing it; 0 when etcd no longer has it."""
        out = await self._call("/v3/lease/keepalive", {"ID": lease})
        result = out.get("result", out)
        return int(result.get("TTL", 0) or 0) if isinstance(result, dict) else 0

    async def revoke(self, lease: int) -> None:
        await self._call("/v3/lease/revoke", {"ID": lease})

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = lease
        await self._call("/v3/kv/put", body)

    async def delete(self, key: bytes) -> None:
        await self._call("/v3/kv/deleterange", {"key": _b64(key)})

    async def get_prefix(self, prefix: bytes) -> tuple[int, list[tuple[bytes, bytes]]]:
        """(the store's revision, every (key, value) under `prefix`)."""
        out = await self._call("/v3/kv/range",
                               {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
        kvs = out.get("kvs") or []
        if not isinstance(kvs, list):
            raise EtcdError(f"etcd {self.target.display}: range answered kvs={kvs!r}")
        return (_int(out.get("header") or {}, "revision"),
                [(_unb64(kv.get("key")), _unb64(kv.get("value"))) for kv in kvs
                 if isinstance(kv, dict)])

    async def watch_prefix(self, prefix: bytes, start_revision: int, *, idle: float
                           ) -> AsyncIterator[WatchBatch]:
        """Batches of changes under `prefix` from `start_revision` on. The first batch
        (empty) says etcd created the watch. Ends with an EtcdError when the stream breaks,
        when etcd does not answer within the call timeout, when the stream stays silent for
        `idle` seconds (a frozen etcd or a half-open connection looks exactly like a quiet
        prefix: the caller watches again from the last `synced` revision, which proves the
        path live), or when etcd cancels the watch (WatchCompacted: read the prefix again).
        The watch asks for etcd's progress notifications: an etcd started with
        --experimental-watch-progress-notify-interval below `idle` keeps the stream alive
        and advances `synced` on a quiet prefix."""
        body = {"create_request": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                   "start_revision": start_revision, "progress_notify": True}}
        request = self._http.build_request("POST", "/v3/watch", json=body,
                                           headers=await self._headers(),
                                           timeout=httpx.Timeout(self._timeout, read=idle))
        synced = start_revision - 1
        resp: httpx.Response | None = None
        created = False
        try:
            resp = await asyncio.wait_for(self._http.send(request, stream=True), self._timeout)
            if resp.status_code != 200:
                raise EtcdError(f"etcd {self.target.display}: watch answered "
                                f"{resp.status_code}")
            lines = resp.aiter_lines()
            line = await asyncio.wait_for(anext(lines, None), self._timeout)
            if line is None:
                raise EtcdError(f"etcd {self.target.display}: watch stream ended at once")
            first = self._watch_events(line, synced)  # "created", or why not (raised)
            if first.head < synced:
                raise WatchCompacted(f"etcd {self.target.display} is at revision {first.head}, "
                                     f"behind {synced}: its store was replaced")
            synced, created = first.synced, True
            yield first
            async for line in lines:
                if line.strip():
                    batch = self._watch_events(line, synced)
                    synced = batch.synced
                    yield batch
        except (asyncio.TimeoutError, httpx.ReadTimeout) as exc:
            if created:  # a quiet prefix, or a path that died under a live watch
                raise WatchSilent(f"etcd {self.target.display}: watch silent for {idle:g} s"
                                  ) from None
            bound = min(self._timeout, idle) if isinstance(exc, httpx.ReadTimeout) else \
                self._timeout
            raise EtcdError(f"etcd {self.target.display}: watch not created within "
                            f"{bound:g} s") from None
        except httpx.HTTPError as exc:
            raise EtcdError(f"etcd {self.target.display}: watch broke: "
                            f"{type(exc).__name__}: {exc}") from exc
        finally:
            if resp is not None:
                await resp.aclose()
        raise EtcdError(f"etcd {self.target.display}: watch stream ended")

    def _watch_events(self, line: str, synced: int) -> WatchBatch:
        try:
            msg = json.loads(line)
        except ValueError:
            raise EtcdError(f"etcd {self.target.display}: watch sent non-JSON") from None
        if not isinstance(msg, dict):
            raise EtcdError(f"etcd {self.target.display}: watch sent {type(msg).__name__}")
        if "error" in msg:
            raise EtcdError(f"etcd {self.target.display}: watch error {msg['error']}")
        result = msg.get("result") or {}
        if result.get("compact_revision"):
            raise WatchCompacted(f"etcd {self.target.display}: watch cancelled (revision "
                                 f"{synced + 1} compacted)")
        if result.get("canceled"):
            raise EtcdError(f"etcd {self.target.display}: watch cancelled "
                            f"({result.get('cancel_reason') or 'no reason given'})")
        events = []
        for ev in result.get("events") or ():
            kv = ev.get("kv") or {}
            events.append(WatchEvent(ev.get("type") == "DELETE", _unb64(kv.get("key")),
                                     _unb64(kv.get("value"))))
            synced = max(synced, _int(kv, "mod_revision"))
        head = _int(result.get("header") or {}, "revision")
        if not events and not result.get("created"):  # a progress notification
            synced = max(synced, head)
        return WatchBatch(events, synced, head)

    # ---- transport --------------------------------------------------------------------------

    async def _headers(self) -> dict[str, str]:
        if self.target.user is None:
            return {}
        if self._token is None:
            out = await self._call("/v3/auth/authenticate", {
                "name": self.target.user, "password": self.target.password or ""}, auth=False)
            self._token = str(out.get("token") or "")
            if not self._token:
                raise EtcdError(f"etcd {self.target.display}: authentication gave no token")
        return {"authorization": self._token}

    async def _call(self, path: str, body: dict[str, Any], *, auth: bool = True
                    ) -> dict[str, Any]:
        for attempt in (0, 1):
            headers = await self._headers() if auth else {}
            try:
                resp = await self._http.post(path, json=body, headers=headers)
            except httpx.HTTPError as exc:
                raise EtcdError(f"etcd {self.target.display}{path}: "
                                f"{type(exc).__name__}: {exc}") from exc
            try:
                out = resp.json()
            except ValueError:
                out = None
            if resp.status_code == 200 and isinstance(out, dict):
                return out
            message = out.get("error") or out.get("message") if isinstance(out, dict) else ""
            if auth and attempt == 0 and self._token and "token" in str(message):
                self._token = None  # expired or revoked: authenticate again, once
                continue
            raise EtcdError(f"etcd {self.target.display}{path}: answered {resp.status_code}"
                            f"{': ' + str(message) if message else ''}")
        raise AssertionError("unreachable")


def _int(obj: dict[str, Any], name: str) -> int:
    try:
        return int(obj[name])
    except (KeyError, TypeError, ValueError):
        raise EtcdError(f"etcd answered without a usable {name!r}: {obj!r}") from None
