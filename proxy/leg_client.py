"""The P legs' HTTP/1.1 client (issue 28): P's first token is on every request's TTFT path.

aiohttp, which carries D's legs, costs ~0.25 ms between `post()` and the request's bytes on
the socket (its body goes out in a task of its own, a turn of the loop later), and delivers
P's chunks through a stream reader, another turn. Here a leg's request is written in the
calling task, in one `write`, and P's body is handed to the caller's `on_body` from
`data_received` itself (httptools, the C parser uvicorn uses), so P's head resolves the
handover's future in the same turn it arrives.

The contract is aiohttp's as the legs used it:
  - keep-alive connections per backend (host, port, scheme), idle ones dropped after
    `keepalive` seconds, at most `limit` requests in flight (a wait for a slot is bounded
    by the leg's total timeout);
  - `timeout.sock_connect` bounds the connect, `timeout.total` the whole leg: both raise
    TimeoutError; a connect that fails raises ConnectFailed (the backend is unreachable), a
    connection that breaks before the answer is whole raises Disconnected;
  - a POST is never retried (a reused connection the server closed meanwhile is a
    Disconnected, as with aiohttp, which retries idempotent methods only);
  - cancelling the caller closes the connection, which aborts the backend's request.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httptools

OnBody = Callable[[bytes, dict[str, str]], None]  # a 200's body as it arrives, its headers


class ConnectFailed(OSError):
    """The connection could not be made (refused, unresolvable, TLS failed)."""


class Disconnected(ConnectionError):
    """The connection broke before the answer was whole."""


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes  # empty when `on_body` took a 200's body


@dataclass(frozen=True)
class _Origin:
    scheme: str
    host: str
    port: int

    @staticmethod
    @functools.lru_cache(maxsize=256)  # a fleet's backend URLs: parsed once, not per leg
    def of(url: str) -> _Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return _Origin(parts.scheme, parts.hostname, port)

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


@dataclass
class _Exchange:
    """One request's answer as the parser sees it."""

    on_body: OnBody | None
    done: asyncio.Future[None]
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    chunks: list[bytes] = field(default_factory=list)
    streaming: bool = False  # a 200 whose body goes to on_body


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: Any = None  # asyncio's or uvloop's (not an asyncio.Transport)
        self.parser = httptools.HttpResponseParser(self)
        self.exchange: _Exchange | None = None
        self.closed = False
        self.reusable = False
        self.idle_since = 0.0

    # ---- asyncio.Protocol -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        ex = self.exchange
        if ex is None or ex.done.done():  # bytes nobody asked for: not reusable
            self.abort()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(Disconnected("the backend switched protocols"))
        except httptools.HttpParserError as exc:
            self._fail(Disconnected(f"malformed HTTP answer: {exc}"))
        except Exception as exc:  # noqa: BLE001 - on_body's error is the caller's
            self._fail(exc)

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        ex = self.exchange
        if ex is not None and not ex.done.done():
            if ex.status and self._until_close():  # an answer delimited by the close
                self.on_message_complete()
            else:
                self._fail(Disconnected(f"the backend closed the connection{_why(exc)}"))

    # ---- httptools callbacks ------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        ex = self.exchange
        assert ex is not None
        ex.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        ex = self.exchange
        assert ex is not None
        ex.status = self.parser.get_status_code()
        ex.streaming = ex.status == 200 and ex.on_body is not None

    def on_body(self, body: bytes) -> None:
        ex = self.exchange
        assert ex is not None
        if ex.streaming:
            assert ex.on_body is not None
            ex.on_body(body, ex.headers)
        else:
            ex.chunks.append(body)

    def on_message_complete(self) -> None:
        ex = self.exchange
        if ex is None or ex.done.done():
            return
        if 100 <= ex.status < 200:  # an interim answer: the real one follows
            ex.status, ex.headers = 0, {}
            return
        self.reusable = self.parser.should_keep_alive() and not self.closed
        ex.done.set_result(None)

    # ---- ours ---------------------------------------------------------------------------

    def _until_close(self) -> bool:
        ex = self.exchange
        assert ex is not None
        return ("content-length" not in ex.headers
                and "chunked" not in ex.headers.get("transfer-encoding", "").lower())

    def _fail(self, exc: BaseException) -> None:
        ex = self.exchange
        if ex is not None and not ex.done.done():
            ex.done.set_exception(exc)
        self.abort()

    def abort(self) -> None:
        self.closed = True
        self.reusable = False
        if self.transport is not None:
            self.transport.abort()


def _why(exc: Exception | None) -> str:
    return f" ({type(exc).__name__}: {exc})" if exc is not None else ""


class LegClient:
    def __init__(self, *, limit: int, keepalive: float,
                 headers: dict[str, str] | None = None) -> None:
        self._slots = asyncio.Semaphore(limit)
        self._keepalive = keepalive
        self._idle: dict[_Origin, list[_Connection]] = {}
        self._default_headers = _render_headers(headers or {})
        self._tls: ssl.SSLContext | None = None
        self._closed = False

    async def post(self, url: str, path: str, body: bytes, headers: dict[str, str], *,
                   total: float | None, connect: float | None,
                   on_body: OnBody | None = None) -> Answer:
        """POST `body` to `url` + `path`; a 200's body goes to `on_body` as it arrives (the
        Answer's body is then empty), any other status's body is read whole."""
        if self._closed:
            raise RuntimeError("leg client closed")
        origin = _Origin.of(url)
        request = b"".join((
            f"POST {path} HTTP/1.1\r\nhost: {origin.host_header}\r\n"
            f"content-length: {len(body)}\r\n".encode("latin-1"),
            self._default_headers, _render_headers(headers), b"\r\n", body))
        async with asyncio.timeout(total):
            async with self._slots:
                conn = self._pooled(origin) or await self._connect(origin, connect)
                try:
                    return await self._exchange(conn, request, on_body)
                finally:
                    self._give_back(origin, conn)

    async def close(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                conn.abort()
        self._idle.clear()

    async def _exchange(self, conn: _Connection, request: bytes,
                        on_body: OnBody | None) -> Answer:
        exchange = _Exchange(on_body, asyncio.get_running_loop().create_future())
        conn.exchange, conn.reusable = exchange, False
        assert conn.transport is not None
        conn.transport.write(request)
        await exchange.done
        return Answer(exchange.status, exchange.headers, b"".join(exchange.chunks))

    def _pooled(self, origin: _Origin) -> _Connection | None:
        conns = self._idle.get(origin)
        now = time.monotonic()
        while conns:
            conn = conns.pop()
            if not conn.closed and now - conn.idle_since < self._keepalive:
                return conn
            conn.abort()
        return None

    async def _connect(self, origin: _Origin, timeout: float | None) -> _Connection:
        loop = asyncio.get_running_loop()
        tls: Any = None
        if origin.scheme == "https":
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(_Connection, origin.host, origin.port,
                                                       ssl=tls)
        except TimeoutError:
            raise TimeoutError(f"connect to {origin.host}:{origin.port} timed out") from None
        except OSError as exc:  # refused, unresolvable (gaierror), TLS (SSLError)
            raise ConnectFailed(f"cannot connect to {origin.host}:{origin.port}: "
                                f"{exc}") from exc
        return conn

    def _give_back(self, origin: _Origin, conn: _Connection) -> None:
        """Back to the pool when its answer was whole and keep-alive; else closed (a
        cancelled or failed exchange: the backend's request is aborted)."""
        exchange, conn.exchange = conn.exchange, None
        whole = exchange is not None and exchange.done.done() and not exchange.done.cancelled(
            ) and exchange.done.exception() is None
        if whole and conn.reusable and not self._closed:
            conn.idle_since = time.monotonic()
            self._idle.setdefault(origin, []).append(conn)
        else:
            conn.abort()


def _render_headers(headers: dict[str, str]) -> bytes:
    lines = []
    for name, value in headers.items():
        if any(c in name or c in value for c in "\r\n\0") or not name or ":" in name:
            raise ValueError(f"refusing to send header {name!r}: control characters or a "
                             "colon in its name")
        if name.lower() in ("host", "content-length", "transfer-encoding"):
            continue  # ours
        lines.append(f"{name}: {value}\r\n")
    return "".join(lines).encode("latin-1")
