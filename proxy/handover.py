"""Zero-bubble handover (issue 28): the client gets P's first token the moment P has it, and a
request that P's token ends is answered by P alone.

How
  - A streaming client's P leg streams too (`HandoverLeg`, proxy/handover_leg.py): its head -
    chat's role chunk and the chunk of token 1, as the engine rendered them - is what the
    colocated server sends first for the same request (same X-Request-Id, so the same `id`;
    P's `created`). The proxy sends it at once (`finish_reason` "length" of P's forced
    max_tokens=1 rewritten to null) and then relays D's stream without D's first token (D is
    seeded with P's token and emits it first; `strip_first`); D's `created` becomes P's.
  - P's head is not sent early when the colocated server would send token 1 differently: a
    character still incomplete (P's finish flushes it as U+FFFD, colocated holds it back), or
    stop strings longer than one character (colocated holds back their possible prefix). D's
    stream then goes to the client whole, as before.
  - Stops on the first token: when P's token ends the request (finish_reason "stop": EOS, a
    stop token or string; or "length" with the client's limit at 1) the client gets P's
    answer alone (its stream, or its JSON with kv_transfer_params null) at once; D's leg is
    not relayed and ends by itself as its KV lands (seeded with a token that ends it: no
    forward pass), which frees P's blocks and D's by the normal path (`Handover._detach`).
  - Not for n > 1, best_of, echo, tools, batched prompts, or a client that opts out of the
    seeded handover (`kv_transfer_params: {first_token: false}`): those go as before.
Counted in `pdserve:proxy_first_token_handover_total{path}`: early (P's token went first),
p_alone (P's answer was the whole answer), decode (D's stream went whole).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import aiohttp
from prometheus_client import Counter
from starlette.responses import Response

from proxy.backends import Lease
from proxy.errors import ProxyError
from proxy.handover_leg import HandoverLeg, Head, strip_first
from proxy.legs import CHAT, REPLACEMENT, DecodeStream, PrefillResult, next_chunk

logger = logging.getLogger("pdserve.proxy")

_LENGTH = b'"finish_reason":"length"'
_TOKEN_TYPES = {int, bool}  # what isinstance(t, int) takes from JSON; judged in C (hot path)


class RequestContext(Protocol):  # proxy/flow.py's, as far as a handover reads it
    route: str
    body: dict[str, Any]
    request_id: str
    started: float
    migration: Any


class Dispatcher(Protocol):  # proxy/flow.py's
    metrics: Any
    migrator: Any

    async def _wait(self, ctx: Any, tasks: set[asyncio.Future[Any]], *,
                    on_give_up: list[asyncio.Task[Any]], what: str,
                    wake: asyncio.Future[None] | None = None) -> None: ...

    def _relay(self, ctx: Any, stream: Any, prefill: Any, *, migrate: bool = True
               ) -> Response: ...

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]: ...


def client_limit(route: str, body: dict[str, Any]) -> int | None:
    """The most tokens the client allows (the engine's defaults: 16 for completions)."""
    if route == CHAT:
        limit = body.get("max_completion_tokens")
        return limit if limit is not None else body.get("max_tokens")
    return body.get("max_tokens", 16)


def eligible(route: str, body: dict[str, Any]) -> bool:
    """Whether P's first token can be the client's (one sequence, nothing held by the proxy's
    legs differently from colocated)."""
    client = body.get("kv_transfer_params")
    if isinstance(client, dict) and client.get("first_token") is False:
        return False
    if not (_one(body.get("n")) and _one(body.get("best_of"))):
        return False
    # The fields P's leg replaces (proxy/legs.py prefill_leg_body) are judged by D alone: a
    # value the engine refuses (`true` for 1, 0, 1.0) must get D's 400, not P's answer
    # (the race P's answer could win when it ends the request, or its early token).
    if not (_count(body.get("max_tokens"), 1) and _count(body.get("max_completion_tokens"), 1)
            and _count(body.get("min_tokens"), 0)):
        return False
    stream = body.get("stream")
    if not (stream is None or isinstance(stream, bool)) or (
            body.get("stream_options") is not None and stream is not True):
        return False  # P's leg sets `stream` and drops `stream_options` unless it streams
    if body.get("echo") or body.get("tools"):
        return False
    prompt = body.get("prompt")
    return route == CHAT or isinstance(prompt, str) or (
        isinstance(prompt, list) and set(map(type, prompt)) <= _TOKEN_TYPES)


def _one(value: Any) -> bool:
    return value is None or (type(value) is int and value == 1)


def _count(value: Any, least: int) -> bool:
    """None, or an int (not a bool: JSON's true) of at least `least`."""
    return value is None or (type(value) is int and value >= least)


def stop_hold(body: dict[str, Any]) -> int:
    """Characters the engine holds back while streaming (engine/frontend/detokenizer.py)."""
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else [s for s in stop or [] if isinstance(s, str)]
    if body.get("include_stop_str_in_output"):
        return 0
    return max((len(s) for s in stops), default=1) - 1


def ends_on_first(route: str, body: dict[str, Any], finish: Any) -> bool:
    return finish == "stop" or (finish == "length" and client_limit(route, body) == 1)


class Handover:
    def __init__(self, dispatcher: Dispatcher) -> None:
        self.d = dispatcher
        self.counter = Counter("pdserve:proxy_first_token_handover",
                               "Disaggregated requests by how their first token reached the "
                               "client: early (P's, before D's stream), p_alone (P's answer "
                               "was the whole answer), decode (D's stream whole).", ["path"],
                               registry=dispatcher.metrics.registry)

    # ---- the P leg ----------------------------------------------------------------------

    def leg(self, ctx: RequestContext) -> HandoverLeg | None:
        """A streamed P leg for a streaming client whose request qualifies, else None."""
        if ctx.body.get("stream") is True and eligible(ctx.route, ctx.body):
            return HandoverLeg()
        return None

    def prefill_body(self, ctx: RequestContext, p_body: dict[str, Any],
                     leg: HandoverLeg | None) -> dict[str, Any]:
        """P's leg streams like the client's request: its chunks are the client's."""
        if leg is None:
            return p_body
        body = {**p_body, "stream": True}
        if "stream_options" in ctx.body:
            body["stream_options"] = ctx.body["stream_options"]
        plan = ctx.migration  # proxy/migrate.py asks D's leg for ids; P's are the client's
        if plan is not None and not getattr(plan, "client_ids", True):
            body.pop("return_token_ids", None)
        return body

    # ---- push: P's head or D's first chunk, whichever comes first -------------------------

    async def first(self, ctx: RequestContext, leg: HandoverLeg | None,
                    prefill: asyncio.Task[PrefillResult], opening: asyncio.Task[DecodeStream],
                    d_lease: Lease) -> Response | None:
        """P's answer alone, or P's head then D's stream; None: go on as before (D whole)."""
        if leg is None and not eligible(ctx.route, ctx.body):  # (a leg was judged eligible)
            return None
        first: asyncio.Future[Any] = leg.head if leg is not None else prefill
        try:
            await self.d._wait(ctx, {first, opening}, on_give_up=[opening, prefill],
                               what=f"decode backend {d_lease.url}",
                               wake=leg.wake if leg is not None else None)
        except BaseException:
            await discard(opening)
            prefill.cancel()
            raise
        if not first.done() or first.cancelled():
            self.counter.labels(path="decode").inc()
            return None  # D answered first: its stream is the whole answer
        if leg is None:
            result = prefill.result()
            if not (result.ok and _json_ends(ctx, result)):
                return None
            self._detach(opening)
            return self._json_alone(ctx, result)
        head = leg.head.result()
        if head is None:
            return None
        if ends_on_first(ctx.route, ctx.body, head.finish):
            self._detach(opening)
            return await self._stream_alone(ctx, leg, prefill)
        return self._early(ctx, head, opening, d_lease, prefill)

    # ---- pull: P has answered; D's leg was just sent ---------------------------------------

    def after_prefill(self, ctx: RequestContext, result: PrefillResult,
                      leg: HandoverLeg | None, opening: asyncio.Task[DecodeStream],
                      d_lease: Lease) -> Response | None:
        """P's answer alone when its token ends the request; else P's head now and D's stream
        after it; None: D's stream whole."""
        if not result.ok or not eligible(ctx.route, ctx.body):
            return None
        if leg is None:
            if not _json_ends(ctx, result):
                return None
            self._detach(opening)
            return self._json_alone(ctx, result)
        head = leg.head.result() if leg.head.done() else None
        if head is None:
            return None
        if ends_on_first(ctx.route, ctx.body, head.finish):
            self._detach(opening)
            return self._sse_response(ctx, leg)
        return self._early(ctx, head, opening, d_lease, None)

    # ---- answers --------------------------------------------------------------------------

    def _early(self, ctx: RequestContext, head: Head, opening: asyncio.Task[DecodeStream],
               d_lease: Lease, prefill: asyncio.Task[PrefillResult] | None) -> Response | None:
        if head.finish != "length" or stop_hold(ctx.body) or head.text.endswith(REPLACEMENT):
            self.counter.labels(path="decode").inc()
            return None  # colocated sends token 1 otherwise: D's stream carries it
        self.counter.labels(path="early").inc()
        stream = HandoverStream(self.d, ctx, head, opening, d_lease)
        return self.d._relay(ctx, stream, prefill, migrate=False)

    async def _stream_alone(self, ctx: RequestContext, leg: HandoverLeg,
                            prefill: asyncio.Task[PrefillResult]) -> Response:
        try:
            await self.d._wait(ctx, {prefill}, on_give_up=[prefill],
                               what="prefill backend (first-token answer)")
        except BaseException:
            prefill.cancel()
            raise
        result = prefill.result()
        if not result.ok or not leg.complete:
            raise ProxyError(502, f"request {ctx.request_id}: prefill backend {result.url} "
                             f"broke off its answer ({result.error or 'no [DONE]'})",
                             code="prefill_failed")
        return self._sse_response(ctx, leg)

    def _sse_response(self, ctx: RequestContext, leg: HandoverLeg) -> Response:
        self._answered(ctx)
        return Response(b"".join(leg.events), media_type="text/event-stream", headers={
            "cache-control": "no-cache", "x-accel-buffering": "no",
            "x-request-id": ctx.request_id})

    def _json_alone(self, ctx: RequestContext, result: PrefillResult) -> Response:
        answer = result.json()
        answer["kv_transfer_params"] = None  # what colocated sends; D never needs P's here
        self._answered(ctx)
        # starlette's JSONResponse rendering, the engine's: the same bytes as colocated
        body = json.dumps(answer, ensure_ascii=False, allow_nan=False, indent=None,
                          separators=(",", ":")).encode()
        return Response(body, media_type="application/json",
                        headers={"x-request-id": ctx.request_id})

    def _detach(self, opening: asyncio.Task[DecodeStream]) -> None:
        """D's leg is not the client's any more: let it end in the background. It ends as its
        KV lands (D is seeded with P's token, which ends it: no forward pass); cancelling it
        at once could beat D's registration to P, whose blocks would then wait for their
        lease to expire (no PUSH_CANCEL / abandon reaches P for a leg D never started)."""
        self.d._spawn(_close_when_open(opening), "proxy-d-detached")

    def _answered(self, ctx: RequestContext) -> None:
        self.counter.labels(path="p_alone").inc()
        elapsed = time.monotonic() - ctx.started
        self.d.metrics.ttft.observe(elapsed)
        self.d.metrics.e2e.observe(elapsed)
        logger.debug("request %s: P's first token ends it; decode leg cancelled",
                     ctx.request_id)


def _json_ends(ctx: RequestContext, result: PrefillResult) -> bool:
    answer = result.json()
    try:
        finish = answer["choices"][0]["finish_reason"]
    except (KeyError, IndexError, TypeError):
        return False
    return isinstance(answer, dict) and ends_on_first(ctx.route, ctx.body, finish)


async def _close_when_open(opening: asyncio.Task[DecodeStream]) -> None:
    """D's first chunk means its request has its KV (and has ended, seeded with a token that
    ends it): close the leg then. A failed or cancelled opening released its lease itself."""
    await asyncio.wait({opening})
    await discard(opening)


async def discard(opening: asyncio.Task[DecodeStream]) -> None:
    """Cancel D's leg whether it is still opening or open (its abort frees D's blocks)."""
    if not opening.done():
        opening.cancel()
        await asyncio.wait({opening})
    if opening.cancelled() or opening.exception() is not None:
        return
    stream = opening.result()
    stream.close()
    stream.lease.release()


class _Headers:
    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = headers


class HandoverStream:
    """A DecodeStream (duck-typed, for RelayResponse): P's head first, then D's stream (opened
    meanwhile, migrating if it breaks) without the token D was seeded with."""

    def __init__(self, dispatcher: Dispatcher, ctx: RequestContext, head: Head,
                 opening: asyncio.Task[DecodeStream], d_lease: Lease) -> None:
        self.d, self.ctx, self.head, self.opening = dispatcher, ctx, head, opening
        self._lease = d_lease
        self._inner: Any = None
        self.response = _Headers(head.headers)
        event = head.events[-1]
        cut = event.rfind(_LENGTH)
        event = event[:cut] + b'"finish_reason":null' + event[cut + len(_LENGTH):]
        self.first_chunk: bytes | None = b"".join(head.events[:-1]) + event
        self.chunks: AsyncIterator[bytes] = self._events()
        self._buffer = b""
        self._stripped = False
        self._created: tuple[bytes, bytes] | None = None

    @property
    def lease(self) -> Lease:
        return self._inner.lease if self._inner is not None else self._lease

    @property
    def is_sse(self) -> bool:
        return True

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()
        elif not self.opening.done():
            self.opening.cancel()  # its done-callback releases D's lease
        elif not self.opening.cancelled() and self.opening.exception() is None:
            stream = self.opening.result()
            stream.close()
            stream.lease.release()

    async def _events(self) -> AsyncIterator[bytes]:
        try:
            stream = await self.opening
        except ProxyError as error:  # the relay reports it in-band: the client has P's token
            raise aiohttp.ClientPayloadError(error.message) from error
        self._inner = self.d.migrator.wrap(self.ctx, stream)
        raw: bytes | None = self._inner.first_chunk
        while raw is not None:
            out = self._feed(raw)
            if out:
                yield out
            raw = await next_chunk(self._inner.chunks)
        if self._buffer:
            yield self._buffer

    def _feed(self, raw: bytes) -> bytes:
        self._buffer += raw
        out: list[bytes] = []
        while b"\n\n" in self._buffer:
            event, self._buffer = self._buffer.split(b"\n\n", 1)
            event += b"\n\n"
            if not self._stripped:
                event = self._strip(event)
            elif self._created is not None:
                event = event.replace(self._created[0], self._created[1], 1)
            out.append(event)
        return b"".join(out)

    def _strip(self, event: bytes) -> bytes:
        """Until D's first token has gone: drop chat's role chunk and that token."""
        if not event.startswith(b"data: ") or event.startswith(b"data: [DONE]"):
            return event
        try:
            obj = json.loads(event[6:])
        except ValueError:
            return event
        if not isinstance(obj, dict) or not obj.get("choices"):
            return event  # an error event, or usage: as D sent it
        created = obj.get("created")
        if isinstance(created, int) and created != self.head.created:
            self._created = (b'"created":%d' % created, b'"created":%d' % self.head.created)
        self._stripped = not _is_role_chunk(obj)
        if not self._stripped:
            return b""
        try:
            rest = strip_first(obj, self.ctx.route == CHAT, self.head.text)
        except ValueError as exc:  # the client has P's token: end the stream in-band
            raise aiohttp.ClientPayloadError(
                f"request {self.ctx.request_id}: {exc}") from exc
        if rest is None:
            return b""
        if self._created is not None:
            rest["created"] = self.head.created
        return b"data: " + json.dumps(rest, ensure_ascii=False, separators=(",", ":")).encode(
            ) + b"\n\n"


def _is_role_chunk(obj: dict[str, Any]) -> bool:
    choice = obj["choices"][0]
    return isinstance(choice, dict) and "role" in (choice.get("delta") or {})
