"""The two legs of a disaggregated request: their bodies, and sending them.

Body builders are pure (dict in, new dict out; the client's body is never mutated).
`run_prefill_leg` never raises (except on cancellation): its outcome is a `PrefillResult`.
`open_decode_leg` returns D's response with its first chunk, or raises `ProxyError`.
Both release their backend lease on every path (the decode lease passes to the relay).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

from kvconnector.params import DECODE_FLAG, PREFILL_FLAG, PrefillLeg, PushDecodeLeg
from proxy.backends import BackendPool, Lease
from proxy.errors import ProxyError, backend_error_body
from proxy.kv_info import PrefillCoordinates
from proxy.leg_client import ConnectFailed, LegClient, OnBody
from proxy.metrics import mark_backend_byte, mark_leg_sent

CHAT = "chat"
COMPLETIONS = "completions"
ROUTE_PATHS = {COMPLETIONS: "/v1/completions", CHAT: "/v1/chat/completions"}
REPLACEMENT = "\ufffd"  # a decode's text for half a UTF-8 character (an engine holds it back)


def new_id() -> str:
    return uuid.uuid4().hex


# ---- bodies -------------------------------------------------------------------------------


def push_prefill_params(transfer_id: str) -> dict[str, Any]:
    return PrefillLeg(transfer_id=transfer_id).to_wire()


def push_decode_params(p: PrefillCoordinates, transfer_id: str) -> dict[str, Any]:
    return PushDecodeLeg(remote_engine_id=p.engine_id, remote_host=p.kv_host,
                         remote_port=p.kv_port, tp_size=p.tp_size,
                         transfer_id=transfer_id).to_wire()


def pull_prefill_params() -> dict[str, Any]:
    return PrefillLeg().to_wire()


def pull_decode_params(p_response: Any) -> dict[str, Any] | None:
    """P's `kv_transfer_params` (verbatim) plus do_remote_prefill; None if P sent none.

    A `do_remote_decode` echoed by P is dropped: it describes P's leg, and a D leg carrying
    both flags is invalid."""
    if not isinstance(p_response, dict):
        return None
    params = p_response.get("kv_transfer_params")
    if not isinstance(params, dict) or not params:
        return None
    params = {k: v for k, v in params.items() if k != PREFILL_FLAG}
    return {**params, DECODE_FLAG: True}


def prefill_leg_body(body: dict[str, Any], route: str, kv_params: dict[str, Any],
                     rank: int | None = None, prompt: dict[str, Any] | None = None
                     ) -> dict[str, Any]:
    """The client's request cut down to a prefill: one token, one choice, no stream; pinned
    to data-parallel rank `rank` of P when given; with the prompt's ids when the proxy
    tokenized it (`prompt`: proxy/routing.py PromptTokens.for_legs; P encodes nothing)."""
    leg = dict(body)
    if prompt is not None:
        leg.update(prompt)
    if rank is not None:
        leg["data_parallel_rank"] = rank
    leg["max_tokens"] = 1
    if route == CHAT:
        leg["max_completion_tokens"] = 1
    leg["stream"] = False
    leg.pop("stream_options", None)
    if leg.get("min_tokens"):  # could exceed max_tokens=1; P samples as D would at 1
        leg["min_tokens"] = 1
    if "n" in leg:
        leg["n"] = 1
    if "best_of" in leg:
        leg["best_of"] = 1
    leg["kv_transfer_params"] = kv_params
    return leg


def decode_leg_body(body: dict[str, Any], kv_params: dict[str, Any] | None,
                    prompt: dict[str, Any] | None = None) -> dict[str, Any]:
    """The client's request as sent; without kv_params D computes the prompt itself. With
    the prompt's ids when the proxy tokenized it (`prompt`, as above; D encodes nothing)."""
    leg = dict(body)
    if prompt is not None:
        leg.update(prompt)
    if kv_params is None:
        leg.pop("kv_transfer_params", None)
    else:
        client = body.get("kv_transfer_params")
        if isinstance(client, dict) and client.get("first_token") is False:
            # the client opts out of D starting from P's token (benchmarks: today's handover)
            kv_params = {**kv_params, "first_token": False}
        leg["kv_transfer_params"] = kv_params
    return leg


_STRICT = msgspec.json.Decoder()
# Set in a request's task (its legs' tasks inherit it) when its body needed json's extensions.
_LENIENT: ContextVar[bool] = ContextVar("pdserve_proxy_lenient_json", default=False)


def decode(data: bytes | bytearray) -> Any:
    """A client's JSON body. msgspec's strict parser first (a third of json's time: 27 vs
    74 us for 1024 token ids, on the proxy's hop); what only json accepts (NaN, Infinity,
    1e999; and UTF-8-encoded surrogates, which json decodes for the body check to name) goes
    to json, and the request's legs are then encoded by json too (`encode`), so the engines
    see the values the client sent. Raises json's ValueError for malformed JSON,
    RecursionError for JSON nested too deeply."""
    try:
        return _STRICT.decode(data)
    except (msgspec.MsgspecError, UnicodeDecodeError):
        value = json.loads(data)
        _LENIENT.set(True)
        return value


def encode(body: dict[str, Any]) -> bytes:
    """A leg's body: msgspec (5 vs 75 us for 1024 ids) writes the same values as json, except
    a non-finite float (as null), which only a body `decode` gave to json can hold."""
    if _LENIENT.get():
        return json.dumps(body, separators=(",", ":")).encode()
    return msgspec.json.encode(body)


# ---- prefill leg --------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillResult:
    """Outcome of a P leg. `status` is None when no HTTP response came back."""

    url: str
    status: int | None
    body: bytes
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def client_error(self) -> bool:
        """P judged the request itself bad (4xx): the client must see it."""
        return self.status is not None and 400 <= self.status < 500

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            return None

    def to_client_error(self, request_id: str) -> ProxyError:
        """For a 4xx: P's own error body when it has the OpenAI shape."""
        passthrough, detail = backend_error_body(self.body)
        return ProxyError(
            self.status or 400, f"request {request_id}: {detail}", body=passthrough,
            code="invalid_request" if passthrough is None else None,
        )


async def run_prefill_leg(
    client: LegClient,
    pool: BackendPool,
    lease: Lease,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str],
    timeout: aiohttp.ClientTimeout,
) -> PrefillResult:
    result = await post_prefill(client, pool, lease, path, body, headers, timeout)
    if result.ok:
        mark_backend_byte()
    return result


async def post_prefill(
    client: LegClient, pool: BackendPool, lease: Lease, path: str,
    body: dict[str, Any], headers: dict[str, str], timeout: aiohttp.ClientTimeout,
    on_body: OnBody | None = None, on_end: Callable[[], None] | None = None,
) -> PrefillResult:
    """Send a P leg (proxy/leg_client.py); a 200 answer's body goes to `on_body` as it
    arrives when given, else it is the result's. Every failure becomes the result's error,
    counted on P's backend; the lease is released (and `on_end` called) on every path."""
    url = lease.url
    try:
        mark_leg_sent()
        answer = await client.post(url, path, encode(body), headers, total=timeout.total,
                                   connect=timeout.sock_connect, on_body=on_body)
    except TimeoutError as exc:
        pool.record_failure(lease.backend, "timeout", unreachable=False)
        return PrefillResult(url, None, b"", f"timed out ({type(exc).__name__})")
    except OSError as exc:  # ConnectFailed, Disconnected (proxy/leg_client.py)
        record_connection_failure(pool, lease, exc)
        return PrefillResult(url, None, b"", f"{type(exc).__name__}: {exc}")
    finally:
        lease.release()
        if on_end is not None:
            on_end()
    status, content = answer.status, answer.body
    if status == 200:
        return PrefillResult(url, 200, content)
    _, detail = backend_error_body(content)
    if status >= 500:
        pool.record_failure(lease.backend, f"http_{status}", unreachable=False)
    return PrefillResult(url, status, content, f"answered {status}: {detail}")


def record_connection_failure(pool: BackendPool, lease: Lease, exc: BaseException) -> None:
    """A leg's connection failed: refused or unresolvable (the backend is unreachable: out of
    rotation at once), or broken after the backend had the request ("disconnected": a reset
    that request may have caused; a health check decides)."""
    if isinstance(exc, aiohttp.ClientConnectorError | ConnectFailed):
        pool.record_failure(lease.backend, "connection", unreachable=True)
    else:
        pool.record_failure(lease.backend, "disconnected", unreachable=False)


# ---- decode leg ---------------------------------------------------------------------------


@dataclass
class DecodeStream:
    """D's response, open, with its first body chunk already read (None: empty body)."""

    lease: Lease
    response: aiohttp.ClientResponse
    chunks: AsyncIterator[bytes]
    first_chunk: bytes | None

    @property
    def is_sse(self) -> bool:
        return self.response.headers.get("content-type", "").startswith("text/event-stream")

    def close(self) -> None:
        """Give the connection back when D's body was read to its end; otherwise close it,
        which aborts D's request."""
        close_response(self.response)


def close_response(resp: aiohttp.ClientResponse) -> None:
    if resp.content.at_eof():
        resp.release()
    else:
        resp.close()


async def cancel_and_wait(*tasks: asyncio.Future[Any]) -> None:
    """Cancel `tasks` and wait until they have ended, retrieving their outcome. Cancelling the
    caller still works (nothing here swallows the caller's CancelledError)."""
    for task in tasks:
        task.cancel()
    await asyncio.wait(tasks)
    for task in tasks:
        if not task.cancelled():
            task.exception()


async def next_chunk(chunks: AsyncIterator[bytes]) -> bytes | None:
    """The next body chunk, or None at the end (a Task cannot carry StopAsyncIteration well)."""
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        return None


async def open_decode_leg(
    client: aiohttp.ClientSession,
    pool: BackendPool,
    lease: Lease,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str],
    timeout: aiohttp.ClientTimeout,
    request_id: str,
) -> DecodeStream:
    """Send the D leg and wait for its first chunk. On any failure the lease is released, the
    backend is counted as failing, and a ProxyError naming D is raised. On success the caller
    owns `lease` and `response` (close both)."""
    url = lease.url
    resp: aiohttp.ClientResponse | None = None
    try:
        try:
            mark_leg_sent()
            resp = await client.post(url + path, data=encode(body), headers=headers,
                                     timeout=timeout)
        except TimeoutError as exc:
            raise _decode_timeout(pool, lease, request_id, exc) from exc
        except aiohttp.ClientError as exc:
            record_connection_failure(pool, lease, exc)
            raise ProxyError(502, f"request {request_id}: decode backend {url} failed: "
                             f"{type(exc).__name__}: {exc}", code="decode_failed") from exc
        if resp.status != 200:
            raw = await resp.read()
            raise _decode_status_error(pool, lease, resp.status, raw, request_id)
        chunks = resp.content.iter_any()
        try:
            first = await next_chunk(chunks)
        except TimeoutError as exc:
            raise _decode_timeout(pool, lease, request_id, exc) from exc
        except aiohttp.ClientError as exc:
            record_connection_failure(pool, lease, exc)
            raise ProxyError(502, f"request {request_id}: decode backend {url} broke off: "
                             f"{type(exc).__name__}: {exc}", code="decode_failed") from exc
        mark_backend_byte()
        return DecodeStream(lease, resp, chunks, first)
    except BaseException:
        if resp is not None:
            close_response(resp)
        lease.release()
        raise


def _decode_timeout(pool: BackendPool, lease: Lease, request_id: str,
                    exc: BaseException) -> ProxyError:
    pool.record_failure(lease.backend, "timeout", unreachable=False)
    return ProxyError(504, f"request {request_id}: decode backend {lease.url} timed out "
                      f"({type(exc).__name__})", code="decode_timeout")


def _decode_status_error(
    pool: BackendPool, lease: Lease, status: int, raw: bytes, request_id: str
) -> ProxyError:
    passthrough, detail = backend_error_body(raw)
    if 400 <= status < 500:
        # the request itself is bad: D's answer goes to the client as it is
        return ProxyError(status, f"request {request_id}: {detail}", body=passthrough)
    pool.record_failure(lease.backend, f"http_{status}", unreachable=False)
    return ProxyError(
        502, f"request {request_id}: decode backend {lease.url} answered {status}: {detail}",
        code="decode_failed",
    )
