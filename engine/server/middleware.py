"""Pure-ASGI guard in front of the app: draining, API key, request body size.

Order per HTTP request:
1. draining (SIGTERM received): every new request but /metrics gets 503;
2. `--api-key`: every route but /health (and /metrics with `--public-metrics`) needs
   `Authorization: Bearer <key>` (401 otherwise): /v1/*, /metrics, /engine_stats,
   /kv_transfer/info, /tokenize, /debug/* and any path the app does not know;
3. body size: a Content-Length over the limit is refused before reading (413); otherwise the
   body is read here, counting bytes as they stream in (413 as soon as the limit is passed),
   and replayed to the app. After the body, `receive` is the server's again, so the app still
   sees `http.disconnect` when the client goes away.
Every response status >= 400, from here or from the app, is reported to `on_error(path,
status)` (the server's `pdserve:http_request_errors_total`).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.server.errors import error_body

_ALWAYS_OPEN = ("/metrics",)


async def _send_error(send: Send, status: int, message: str, code: str,
                      extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(error_body(message, status, code=code)).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())] + (extra_headers or [])
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class GuardMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        max_body_bytes: int,
        is_draining: Callable[[], bool],
        public_metrics: bool = False,
        on_error: Callable[[str, int], None] | None = None,
    ) -> None:
        self.app = app
        self.on_error = on_error
        self.api_key = api_key
        self.open_paths = frozenset(("/health", "/metrics") if public_metrics else ("/health",))
        self.max_body_bytes = max_body_bytes
        self.is_draining = is_draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        if self.on_error is not None:
            send = _reporting(send, path, self.on_error)
        if self.is_draining() and path not in _ALWAYS_OPEN:
            await _send_error(send, 503, "the server is shutting down", "draining",
                              [(b"connection", b"close")])
            return
        if (self.api_key is not None and path not in self.open_paths
                and not self._authorized(scope)):
            await _send_error(send, 401, "missing or invalid API key", "invalid_api_key",
                              [(b"www-authenticate", b"Bearer")])
            return
        length = self._content_length(scope)
        if length is not None and length > self.max_body_bytes:
            await _send_error(send, 413, f"request body over {self.max_body_bytes} bytes",
                              "request_too_large", [(b"connection", b"close")])
            return
        if scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await _send_error(send, 413, f"request body over {self.max_body_bytes} bytes",
                                  "request_too_large", [(b"connection", b"close")])
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    return hmac.compare_digest(token.strip().encode(), self.api_key.encode())
        return False

    @staticmethod
    def _content_length(scope: Scope) -> int | None:
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return None
        return None


def _reporting(send: Send, path: str, on_error: Callable[[str, int], None]) -> Send:
    async def reporting(message: Message) -> None:
        if message["type"] == "http.response.start" and message["status"] >= 400:
            on_error(path, message["status"])
        await send(message)

    return reporting


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
