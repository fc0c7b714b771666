"""Leg dispatch: one client request becomes a P leg and a D leg (push: at once; pull: in turn).

Invariants
  - Both legs carry the same X-Request-Id, made by the proxy for this request (the client's
    is only a label, `RequestContext.request_id`); in push mode also the same transfer_id,
    also fresh per request, so P and D pair by transfer_id alone.
  - Every request ends within `request_timeout`: with D's answer, or an OpenAI error body.
  - No leg outlives its request's interest in it: a client disconnect, a D failure or a P
    verdict that cancels the request aborts the other leg's HTTP request. A successful D
    answer lets P's leg finish in the background (bounded by the same deadline).
  - Every backend lease is released on every path (the relay owns D's once it starts).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
from starlette.responses import Response

from proxy.backends import BackendPool, Lease
from proxy.config import ProxyConfig
from proxy.errors import ProxyError
from proxy.handover import Handover
from proxy.handover_leg import HandoverLeg, run_prefill_stream
from proxy.kv_info import KVInfoCache, KVInfoError, PrefillCoordinates
from proxy.leg_client import LegClient
from proxy.legs import (
    CHAT,
    DecodeStream,
    PrefillResult,
    cancel_and_wait,
    decode_leg_body,
    new_id,
    open_decode_leg,
    prefill_leg_body,
    pull_decode_params,
    pull_prefill_params,
    push_decode_params,
    push_prefill_params,
    run_prefill_leg,
)
from proxy.metrics import ProxyMetrics
from proxy.migrate import Migrator
from proxy.prompt_rows import wants_prompt_logprobs
from proxy.relay import COMPLETED, RelayResponse
from proxy.retry import RetryPair, RetryPolicy
from proxy.routing import NO_TOKENS, PromptTokens, RequestView, Route, Router

logger = logging.getLogger("pdserve.proxy")


class ClientGone(Exception):
    """The client disconnected before the response started."""


@dataclass
class RequestContext:
    route: str  # legs.COMPLETIONS or legs.CHAT
    path: str  # the backend path for the legs
    body: dict[str, Any]
    headers: dict[str, str]  # for both legs: X-Request-Id, Authorization, Content-Type
    request_id: str  # the client's label: echoed, logged, never sent to an engine
    started: float  # time.monotonic() at arrival
    deadline: float
    disconnect: asyncio.Future[None]  # done when the client has gone
    engine_request_id: str = ""  # the legs' X-Request-Id, fresh per request
    retry_open: bool = False  # a failed leg may go to another pair (proxy/retry.py)
    migration: Any = None  # a streamed answer's migration plan (proxy/migrate.py)
    tokens: PromptTokens = NO_TOKENS  # the prompt's ids, made once (proxy/routing.py)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


_LEG_BACKSTOP_S = 1.0


class Dispatcher:
    def __init__(
        self,
        config: ProxyConfig,
        client: aiohttp.ClientSession,
        p_client: LegClient,
        prefill: BackendPool,
        decode: BackendPool,
        kv_info: KVInfoCache,
        metrics: ProxyMetrics,
        router: Router,
    ) -> None:
        self.config = config
        self.router = router
        self.client = client  # D's legs, and the relay
        self.p_client = p_client  # P's legs: their bytes are on TTFT's path (leg_client.py)
        self.prefill = prefill
        self.decode = decode
        self.kv_info = kv_info
        self.metrics = metrics
        self._tasks: set[asyncio.Task[Any]] = set()
        self.retry = RetryPolicy(config.retries, metrics)
        self.migrator = Migrator(self)
        self.handover = Handover(self)  # P's first token to the client (proxy/handover.py)

    # ---- entry ------------------------------------------------------------------------------

    async def dispatch(self, ctx: RequestContext) -> Response:
        """The client's response (a relay, or an error). Raises ProxyError or ClientGone."""
        logger.debug("request %s: engine request id %s", ctx.request_id,
                     ctx.engine_request_id)
        self.migrator.prepare(ctx)  # a streamed D leg reports token ids (proxy/migrate.py)
        ctx.tokens = await self.router.prompt_tokens(ctx.body, ctx.route == CHAT)
        if self.config.mode == "push":
            return await self.retry.run(ctx, lambda: self._push(ctx))
        return await self.retry.run(ctx, lambda: self._pull(ctx))

    async def shutdown(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- push: both legs at once --------------------------------------------------------

    async def _push(self, ctx: RequestContext) -> Response:
        route, view = self._route(ctx)
        if route.alone:
            return await self._run_decode_alone(ctx, route, view)
        d_lease = self.router.take_decode(route)  # before any await (routing.take_decode)
        if d_lease is None:
            raise self._no_healthy(ctx, self.decode)
        try:
            p_lease, coords = await self._choose_prefill_with_info(ctx, route, view)
        except ProxyError as error:
            d_lease.release()
            return await self._decode_alone(ctx, error)
        except BaseException:
            d_lease.release()
            raise
        coords = pin_prefill_rank(p_lease, coords)
        self.router.account_decode(view, d_lease, p_lease)
        transfer_id = new_id()
        logger.debug("request %s: push transfer %s P=%s D=%s",
                     ctx.request_id, transfer_id, p_lease.url, d_lease.url)
        p_body = prefill_leg_body(ctx.body, ctx.route, push_prefill_params(transfer_id),
                                  p_lease.rank, ctx.tokens.for_legs)
        leg = self.handover.leg(ctx)
        prefill = self._spawn_prefill(ctx, p_lease, p_body, leg)
        try:
            # a turn of the loop: P's leg writes its request now, before D's body is built
            # and D's leg and this request's waits are set up (P's bytes are on the client's
            # TTFT path; D's wait for P's prefill anyway)
            await asyncio.sleep(0)
        except BaseException:
            prefill.cancel()
            d_lease.release()
            raise
        d_body = decode_leg_body(ctx.body, push_decode_params(coords, transfer_id),
                                 ctx.tokens.for_legs)
        opening = self._spawn_decode(ctx, d_lease, d_body)
        answer = await self.handover.first(ctx, leg, prefill, opening, d_lease)
        if answer is not None:
            return answer
        stream = await self._await_decode(ctx, opening, prefill, d_lease.url)
        return self._relay(ctx, stream, prefill)

    async def _choose_prefill_with_info(
        self, ctx: RequestContext, route: Route, view: RequestView
    ) -> tuple[Lease, PrefillCoordinates]:
        tried: list[Any] = []
        errors: list[str] = []
        while True:
            lease = self.router.lease_prefill(route, view, exclude=tried)
            if lease is None:
                raise self._no_healthy(ctx, self.prefill, errors)
            coords = self.kv_info.cached(lease.url)  # the common case: no task, no wait
            if coords is not None:
                return lease, coords
            try:
                return lease, await self._kv_info(ctx, lease, self.kv_info.get(lease.url))
            except KVInfoError as exc:
                lease.release()
                self.prefill.record_failure(lease.backend, "kv_info", unreachable=True)
                tried.append(lease.backend)
                errors.append(str(exc))
                logger.warning("request %s: %s", ctx.request_id, exc)

    # ---- pull: P first, then D with P's kv_transfer_params -----------------------------

    async def _pull(self, ctx: RequestContext) -> Response:
        route, view = self._route(ctx)
        if route.alone:
            return await self._run_decode_alone(ctx, route, view)
        p_lease = self.router.lease_prefill(route, view)
        if p_lease is None:
            return await self._decode_alone(ctx, self._no_healthy(ctx, self.prefill))
        d_lease = self.router.take_decode(route)  # before any await, as in _push
        if d_lease is None:
            p_lease.release()
            raise self._no_healthy(ctx, self.decode)
        try:
            return await self._pull_legs(ctx, view, p_lease, d_lease)
        except BaseException:
            d_lease.release()  # idempotent: a leg that took it over released it too
            raise

    async def _pull_legs(self, ctx: RequestContext, view: RequestView, p_lease: Lease,
                         d_lease: Lease) -> Response:
        coords = await self._kv_info(ctx, p_lease, self.kv_info.get_optional(p_lease.url))
        if coords is not None:  # P's answer names the rank's side channel itself
            pin_prefill_rank(p_lease, coords)
        p_body = prefill_leg_body(ctx.body, ctx.route, pull_prefill_params(), p_lease.rank,
                                  ctx.tokens.for_legs)
        # a streamed P leg only to our own engines (they send kv_transfer_params in a stream)
        leg = self.handover.leg(ctx) if coords is not None else None
        prefill = self._spawn_prefill(ctx, p_lease, p_body, leg)
        await self._wait(ctx, {prefill}, on_give_up=[prefill],
                         what=f"prefill backend {p_lease.url}")
        result = prefill.result()
        kv_params = None
        if result.ok:
            kv_params = pull_decode_params(result.json())
            if kv_params is None:
                result = PrefillResult(result.url, result.status, result.body,
                                       "answered without kv_transfer_params")
        error = self._judge(ctx, result)
        if error is not None:
            raise error
        self.router.account_decode(view, d_lease, p_lease)
        d_body = decode_leg_body(ctx.body, kv_params, ctx.tokens.for_legs)
        opening = self._spawn_decode(ctx, d_lease, d_body)
        # P's answer alone when its token ends the request, else P's token first
        answer = self.handover.after_prefill(ctx, result, leg, opening, d_lease)
        if answer is not None:
            return answer
        stream = await self._await_decode(ctx, opening, None, d_lease.url)
        return self._relay(ctx, stream, None)

    async def _decode_alone(self, ctx: RequestContext, no_prefill: ProxyError) -> Response:
        """No prefill backend can take the request (none healthy: stopped, restarting, all
        gone): under --p-failure-policy recompute D computes the prompt itself, as it does
        after a failed P leg, instead of the client getting a 503."""
        if (no_prefill.code != "no_healthy_prefill"
                or self.config.p_failure_policy != "recompute"):
            raise no_prefill
        d_lease = self.decode.choose()
        if d_lease is None:
            raise self._no_healthy(ctx, self.decode)
        self.metrics.prefill_failures.labels(action="decode_alone").inc()
        logger.warning("request %s: %s; decode computes the prompt itself "
                       "(--p-failure-policy recompute)", ctx.request_id, no_prefill.message)
        return await self._open_alone(ctx, d_lease)

    def _route(self, ctx: RequestContext) -> tuple[Route, RequestView]:
        """The routing policy's choice (proxy/routing.py); a 503 when no D is healthy."""
        routed = self.router.route(ctx.tokens)
        if routed is None:
            raise self._no_healthy(ctx, self.decode)
        route, view = routed
        if not route.alone and wants_prompt_logprobs(ctx.body):  # proxy/prompt_rows.py
            route = replace(route, prefill=[], alone=True, reason="prompt_logprobs")
        return route, view

    async def _run_decode_alone(self, ctx: RequestContext, route: Route, view: RequestView
                                ) -> Response:
        """Conditional disaggregation: the policy sent the request to D alone, which
        prefills it locally (`route.reason`: short_uncached, prefill_saturated)."""
        d_lease = self.router.lease_decode(route, view, None)
        if d_lease is None:
            raise self._no_healthy(ctx, self.decode)
        logger.debug("request %s: decode %s alone (%s)", ctx.request_id, d_lease.url,
                     route.reason)
        return await self._open_alone(ctx, d_lease)

    async def _open_alone(self, ctx: RequestContext, d_lease: Lease) -> Response:
        opening = self._spawn_decode(ctx, d_lease,
                                     decode_leg_body(ctx.body, None, ctx.tokens.for_legs))
        stream = await self._await_decode(ctx, opening, None, d_lease.url)
        return self._relay(ctx, stream, None)

    # ---- shared steps -------------------------------------------------------------------

    async def _kv_info(self, ctx: RequestContext, lease: Lease, fetch: Coroutine[Any, Any, Any]
                       ) -> Any:
        """P's /kv_transfer/info for `lease`, unless the client leaves or the deadline passes
        first: every way out but an answer (also an error, or being cancelled) releases the
        lease, as no leg has taken it over yet."""
        task = asyncio.ensure_future(fetch)
        try:
            await self._wait(ctx, {task}, on_give_up=[task],
                             what=f"prefill backend {lease.url} (/kv_transfer/info)")
            return task.result()
        except BaseException:
            task.cancel()
            lease.release()
            raise

    def _leg_timeout(self, ctx: RequestContext) -> aiohttp.ClientTimeout:
        # The request deadline is enforced by the waits (here and in the relay), which answer
        # 504 "timeout"; a leg's own total is only a backstop just after it.
        remaining = max(0.001, ctx.remaining())
        return aiohttp.ClientTimeout(total=remaining + _LEG_BACKSTOP_S,
                                     sock_connect=min(self.config.connect_timeout, remaining))

    async def _prefill_leg(
        self, ctx: RequestContext, lease: Lease, body: dict[str, Any]
    ) -> PrefillResult:
        result = await run_prefill_leg(self.p_client, self.prefill, lease, ctx.path, body,
                                       ctx.headers, self._leg_timeout(ctx))
        if not result.ok and not result.client_error:
            self.kv_info.invalidate(result.url)
            logger.warning("request %s: prefill backend %s %s",
                           ctx.request_id, result.url, result.error)
        return result

    async def _open_decode(
        self, ctx: RequestContext, lease: Lease, body: dict[str, Any]
    ) -> DecodeStream:
        return await open_decode_leg(self.client, self.decode, lease, ctx.path, body,
                                     ctx.headers, self._leg_timeout(ctx), ctx.request_id)

    def _judge(self, ctx: RequestContext, result: PrefillResult) -> ProxyError | None:
        """What a finished P leg means for the request: None to go on, else the error to send."""
        if result.ok:
            return None
        if result.client_error:
            self.metrics.prefill_failures.labels(action="client_error").inc()
            return result.to_client_error(ctx.request_id)
        if ctx.retry_open:  # the client has no byte yet: another pair first
            raise RetryPair("prefill", result.url, result.error)
        if self.config.p_failure_policy == "cancel":
            self.metrics.prefill_failures.labels(action="cancel").inc()
            return ProxyError(
                502, f"request {ctx.request_id}: prefill backend {result.url} {result.error}; "
                "request cancelled (--p-failure-policy cancel)", code="prefill_failed")
        self.metrics.prefill_failures.labels(action="recompute").inc()
        logger.warning("request %s: prefill backend %s %s; decode goes on and recomputes "
                       "the prompt (--p-failure-policy recompute)",
                       ctx.request_id, result.url, result.error)
        return None

    async def _await_decode(
        self,
        ctx: RequestContext,
        opening: asyncio.Task[DecodeStream],
        prefill: asyncio.Task[PrefillResult] | None,
        decode_url: str,
    ) -> DecodeStream:
        """Wait for D's first chunk while judging P's outcome if it comes first."""
        give_up = [opening] + ([prefill] if prefill is not None else [])
        watching = prefill is not None
        try:
            while not opening.done():
                waiting: set[asyncio.Future[Any]] = {opening}
                if watching:
                    waiting.add(prefill)
                await self._wait(ctx, waiting, on_give_up=give_up,
                                 what=f"decode backend {decode_url}")
                if watching and prefill.done():
                    watching = False
                    error = self._judge(ctx, prefill.result())
                    if error is not None:
                        raise error
            return opening.result()
        except BaseException:
            await _discard_decode(opening)
            if prefill is not None and not prefill.done():
                prefill.cancel()
            raise

    async def _wait(
        self,
        ctx: RequestContext,
        tasks: set[asyncio.Future[Any]],
        *,
        on_give_up: list[asyncio.Task[Any]],
        what: str,
        wake: asyncio.Future[None] | None = None,
    ) -> None:
        """Wait until one of `tasks` is done. On client disconnect or deadline, cancel
        `on_give_up` and raise ClientGone / a 504 ProxyError.

        `wake`: a future the awaited event's producer resolves itself (HandoverLeg.wake: P's
        head), so that it wakes this task in one turn of the loop; asyncio.wait takes two (a
        done-callback, then the waiter's), during which P's reader goes on parsing."""
        watched = [*tasks, ctx.disconnect]
        if not any(task.done() for task in watched):
            loop = asyncio.get_running_loop()
            waker = wake if wake is not None and not wake.done() else loop.create_future()

            def fire(_: Any = None) -> None:
                if not waker.done():
                    waker.set_result(None)

            for task in watched:
                task.add_done_callback(fire)
            timer = loop.call_later(max(0.0, ctx.remaining()), fire)
            try:
                await waker
            finally:
                timer.cancel()
                for task in watched:
                    task.remove_done_callback(fire)
        done = any(task.done() for task in tasks)
        if ctx.disconnect.done():
            for task in on_give_up:
                task.cancel()
            logger.info("request %s: client disconnected; legs cancelled", ctx.request_id)
            raise ClientGone(ctx.request_id)
        if not done:
            for task in on_give_up:
                task.cancel()
            raise ProxyError(504, f"request {ctx.request_id}: no answer within the request "
                             f"timeout ({self.config.request_timeout:g} s) from {what}",
                             code="timeout")

    def _relay(
        self, ctx: RequestContext, stream: DecodeStream,
        prefill: asyncio.Task[PrefillResult] | None, *, migrate: bool = True,
    ) -> RelayResponse:
        ctx.retry_open = False  # from here on the client may have bytes
        if migrate:  # (a handover stream wraps its D leg itself)
            stream = self.migrator.wrap(ctx, stream)  # a D that dies mid-stream is replaced

        def on_first_byte() -> None:
            self.metrics.ttft.observe(time.monotonic() - ctx.started)

        def on_close(reason: str) -> None:
            self.metrics.e2e.observe(time.monotonic() - ctx.started)
            if reason != COMPLETED:
                self.metrics.stream_aborts.labels(reason=reason).inc()
                if prefill is not None and not prefill.done():
                    prefill.cancel()

        return RelayResponse(
            stream,
            request_id=ctx.request_id,
            deadline=ctx.deadline,
            prefill=prefill if prefill is not None and not prefill.done() else None,
            judge=lambda result: self._judge(ctx, result),
            on_first_byte=on_first_byte,
            on_close=on_close,
        )

    def _no_healthy(
        self, ctx: RequestContext, pool: BackendPool, errors: list[str] | None = None
    ) -> ProxyError:
        detail = "; ".join(errors or [b.url + ": " + b.last_error for b in pool.backends])
        return ProxyError(503, f"request {ctx.request_id}: no healthy {pool.role} backend "
                          f"({detail})", code=f"no_healthy_{pool.role}")

    def _spawn_prefill(
        self, ctx: RequestContext, lease: Lease, body: dict[str, Any],
        leg: HandoverLeg | None = None,
    ) -> asyncio.Task[PrefillResult]:
        if leg is not None:  # streamed like the client's request (proxy/handover.py)
            body = self.handover.prefill_body(ctx, body, leg)
            coro = run_prefill_stream(self.p_client, self.prefill, lease, ctx.path, body,
                                      ctx.headers, self._leg_timeout(ctx), leg)
        else:
            coro = self._prefill_leg(ctx, lease, body)
        task = self._spawn(coro, "proxy-p-leg")
        # a task cancelled before its first step never runs its finally blocks
        task.add_done_callback(lambda _: lease.release())
        return task

    def _spawn_decode(
        self, ctx: RequestContext, lease: Lease, body: dict[str, Any]
    ) -> asyncio.Task[DecodeStream]:
        task = self._spawn(self._open_decode(ctx, lease, body), "proxy-d-open")

        def release_unless_open(t: asyncio.Task[DecodeStream]) -> None:
            if t.cancelled() or t.exception() is not None:
                lease.release()  # on success the lease passes to the relay

        task.add_done_callback(release_unless_open)
        return task

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


def pin_prefill_rank(lease: Lease, coords: PrefillCoordinates) -> PrefillCoordinates:
    """With a data-parallel P: pin the leg to the live rank with the fewest outstanding legs
    and return that rank's coordinates (D's push leg names them); otherwise `coords`."""
    live = coords.live_ranks
    return coords.for_rank(lease.pin_rank(live)) if live else coords


async def _discard_decode(opening: asyncio.Task[DecodeStream]) -> None:
    """Cancel the D leg whether it is still opening or already open."""
    if not opening.done():
        await cancel_and_wait(opening)
    if opening.cancelled() or opening.exception() is not None:
        return
    stream = opening.result()
    stream.close()
    stream.lease.release()
