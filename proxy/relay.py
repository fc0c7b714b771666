"""Streaming relay: D's body goes to the client chunk by chunk as it arrives, never buffered.

`RelayResponse` is a raw ASGI response. While it pumps D's chunks it also
  - listens for the client's disconnect (and then stops at once, whatever D is doing),
  - watches the P leg, if still running, for a verdict that ends the stream
    (P's 4xx, or any P failure under --p-failure-policy cancel),
  - enforces the request deadline.
An SSE answer is complete for the client at D's `data: [DONE]` event (D's body end is then
drained briefly, so a client hanging up at [DONE] is no disconnect). A failure after the first
byte is reported in-band for SSE (an OpenAI error event, then `[DONE]`) and by closing the
connection otherwise. On every path D's response is closed
(which aborts D's request) and `on_close(reason)` is called exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from proxy.errors import ProxyError
from proxy.legs import (
    DecodeStream,
    PrefillResult,
    cancel_and_wait,
    next_chunk,
    record_connection_failure,
)

logger = logging.getLogger("pdserve.proxy")

COMPLETED = "completed"
CLIENT_DISCONNECT = "client_disconnect"
PREFILL_FAILED = "prefill_failed"
DECODE_FAILED = "decode_failed"
TIMEOUT = "timeout"

_HOP_BY_HOP = {"content-length", "transfer-encoding", "connection", "keep-alive",
               "content-encoding", "server", "date"}


_DRAIN_SECONDS = 1.0
_DONE = b"data: [DONE]"


def ends_with_done_event(tail: bytes) -> bool:
    """Whether an SSE byte stream ends with the complete `data: [DONE]` event."""
    if not (tail.endswith(b"\n\n") or tail.endswith(b"\r\n\r\n")):
        return False
    event = tail.rstrip(b"\r\n")
    return event == _DONE or event.endswith(b"\n" + _DONE)


class _Abort(Exception):
    def __init__(self, reason: str, error: ProxyError) -> None:
        super().__init__(error.message)
        self.reason = reason
        self.error = error


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns when the client has gone (the request body must have been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class RelayResponse(Response):
    def __init__(
        self,
        stream: DecodeStream,
        *,
        request_id: str,
        deadline: float,
        prefill: asyncio.Task[PrefillResult] | None,
        judge: Callable[[PrefillResult], ProxyError | None],
        on_first_byte: Callable[[], None],
        on_close: Callable[[str], None],
    ) -> None:
        self.stream = stream
        self.request_id = request_id
        self.deadline = deadline
        self.prefill = prefill
        self.judge = judge
        self.on_first_byte = on_first_byte
        self.on_close = on_close
        self._sent_first_byte = False
        self._tail = b""  # the last bytes sent, for the [DONE] check
        self._upstream_ended = False
        self._expired = False  # the deadline's timer cancelled the pump
        self.status_code = 200
        self.background = None
        headers = {k: v for k, v in stream.response.headers.items()
                   if k.lower() not in _HOP_BY_HOP and not k.lower().startswith("x-")}
        headers["x-request-id"] = request_id
        if stream.is_sse:
            headers.setdefault("cache-control", "no-cache")
            headers["x-accel-buffering"] = "no"
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        reason = COMPLETED
        tasks: list[asyncio.Future[Any]] = []
        try:
            # the head inline, not in the pump's task: the client's first byte does not wait
            # for a turn of the loop (the proxy hop, issue 28)
            complete = await self._send_head(send)
            pump = asyncio.ensure_future(self._pump(send, complete))
            # one timer for the whole answer, not a cancel scope around every chunk (the
            # relay's per-chunk cost is the proxy's CPU under load, issue 33)
            deadline = asyncio.get_running_loop().call_later(
                max(0.0, self.deadline - time.monotonic()), self._expire, pump)
            listener = asyncio.ensure_future(wait_for_disconnect(receive))
            tasks = [pump, listener]
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if pump.done():
                reason = pump.result()
            else:
                reason = CLIENT_DISCONNECT
                logger.info("request %s: client disconnected; aborting decode leg %s",
                            self.request_id, self.stream.lease.url)
        except OSError:
            reason = CLIENT_DISCONNECT  # a server that reports a gone client by failing send()
        except asyncio.CancelledError:
            reason = CLIENT_DISCONNECT  # the server is cancelling us: shutdown or a lost client
            raise
        except Exception:
            reason = "error"
            logger.exception("request %s: relay failed", self.request_id)
            raise
        finally:
            try:
                if tasks:
                    deadline.cancel()
                    await cancel_and_wait(*tasks)
                if reason == COMPLETED and not self._upstream_ended:
                    await self._drain_upstream()
                self.stream.close()
            finally:
                self.stream.lease.release()
                self.on_close(reason)

    async def _drain_upstream(self) -> None:
        """Read D's body to its end (briefly) so its connection can be reused."""
        with anyio.move_on_after(_DRAIN_SECONDS):
            try:
                while await next_chunk(self.stream.chunks) is not None:
                    pass
            except (aiohttp.ClientError, TimeoutError):
                pass

    async def _send_head(self, send: Send) -> bool:
        """The response start and D's first chunk; True when that chunk ends the SSE answer."""
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        chunk = self.stream.first_chunk
        if not chunk:
            return False
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
        self._sent_first_byte = True
        self.on_first_byte()
        self._tail = chunk[-32:]
        return self.stream.is_sse and ends_with_done_event(self._tail)

    async def _pump(self, send: Send, complete: bool) -> str:
        """D's chunks after the first (`_send_head`), to the end of the answer."""
        chunk = None if self.stream.first_chunk is None else b""
        tail = self._tail
        try:
            # a complete answer ends now, not when D closes its body, or a client that
            # hangs up at [DONE] would look like a disconnect
            while chunk is not None and not complete:
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    if not self._sent_first_byte:
                        self._sent_first_byte = True
                        self.on_first_byte()
                    tail = (tail + chunk)[-32:]
                    complete = self.stream.is_sse and ends_with_done_event(tail)
                    if complete:
                        break
                chunk = await self._next()
            else:
                self._upstream_ended = chunk is None
        except (_Abort, asyncio.CancelledError) as exc:
            if isinstance(exc, asyncio.CancelledError) and not self._expired:
                raise
            abort = exc if isinstance(exc, _Abort) else self._timeout()  # the deadline's cancel
            logger.warning("request %s: stream ended early (%s): %s",
                           self.request_id, abort.reason, abort.error.message)
            if self.stream.is_sse:
                await send({"type": "http.response.body",
                            "body": abort.error.sse_event() + b"data: [DONE]\n\n",
                            "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            # not SSE: returning without the final body message makes the server drop the
            # connection, so the client sees a broken response instead of a truncated one
            return abort.reason
        # D's answer is complete: its leg no longer counts as outstanding. Released before
        # the client sees the end, so a client's next request is balanced on the new count.
        self.stream.lease.release()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return COMPLETED

    def _expire(self, pump: asyncio.Future[str]) -> None:
        """The request's deadline: the pump, wherever it waits, ends with a timeout."""
        if not pump.done():
            self._expired = True
            pump.cancel()

    async def _next(self) -> bytes | None:
        """The next chunk (the deadline is the pump's timer, `_expire`)."""
        if self.prefill is not None:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise self._timeout()
            if not self.prefill.done():
                return await self._next_watching_prefill(remaining)
            self._judge_prefill()
        try:
            return await next_chunk(self.stream.chunks)
        except TimeoutError:  # the leg's own total timeout: the same deadline
            raise self._timeout() from None
        except aiohttp.ClientError as exc:
            raise self._decode_broke(exc) from exc

    async def _next_watching_prefill(self, remaining: float) -> bytes | None:
        assert self.prefill is not None
        step = asyncio.ensure_future(next_chunk(self.stream.chunks))
        try:
            await asyncio.wait({step, self.prefill}, timeout=remaining,
                               return_when=asyncio.FIRST_COMPLETED)
            if self.prefill.done():
                self._judge_prefill()
            if not step.done() and self.prefill is None:
                await asyncio.wait({step}, timeout=max(0.0, self.deadline - time.monotonic()))
        except BaseException:
            await cancel_and_wait(step)  # before anyone closes the stream it is reading
            raise
        if not step.done():
            await cancel_and_wait(step)
            raise self._timeout()
        return self._result(step)

    def _judge_prefill(self) -> None:
        """P has finished: apply the verdict once. Raises _Abort if the stream must end."""
        assert self.prefill is not None and self.prefill.done()
        task, self.prefill = self.prefill, None
        if task.cancelled():
            return
        error = self.judge(task.result())
        if error is None:
            return
        raise _Abort(PREFILL_FAILED, error)  # the caller cancels `step`

    def _result(self, step: asyncio.Future[bytes | None]) -> bytes | None:
        try:
            return step.result()
        except TimeoutError:  # the leg's own total timeout: the same deadline
            raise self._timeout() from None
        except aiohttp.ClientError as exc:
            raise self._decode_broke(exc) from exc

    def _decode_broke(self, exc: Exception) -> _Abort:
        lease = self.stream.lease
        record_connection_failure(lease.pool, lease, exc)
        return _Abort(DECODE_FAILED, ProxyError(
            502, f"request {self.request_id}: decode backend {lease.url} broke off the "
            f"stream: {type(exc).__name__}: {exc}", code="decode_failed"))

    def _timeout(self) -> _Abort:
        return _Abort(TIMEOUT, ProxyError(
            504, f"request {self.request_id}: no complete answer within the request timeout "
            f"(decode backend {self.stream.lease.url})", code="timeout"))
