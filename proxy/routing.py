"""Where a request goes: a pair (P, D), or D alone. One `RoutingPolicy` per `--routing`.

  least-outstanding  P and D each the healthy backend with the fewest legs in flight (ties
                     round-robin): the proxy's choice before routing policies existed.
  round-robin        P and D in turn, whatever their load.
  kv-aware           (default) scores each P by the prompt tokens it would compute (those
                     its prefix cache lacks) plus the prompt tokens already queued on it, and
                     each D by what it lacks plus DECODE_LOAD_TOKENS per request running
                     there (its legs in flight, or the running requests its last health poll
                     read, whichever is more); a D whose free KV blocks (that poll) cannot
                     hold the part it lacks is chosen only when no D can. With
                     `--disagg-min-tokens N`, a request whose uncached part on the chosen D
                     is below N runs on D alone ("short_uncached"), and so does one that finds
                     every P saturated (`--prefill-max-outstanding` legs each) while D has
                     room ("prefill_saturated"). Without tokens (no --tokenizer, or a prompt
                     the proxy cannot render) it routes by load alone ("no_tokens").

Tokenize once: with --tokenizer the proxy renders and encodes each prompt with the engine's
own code (engine/server/chat.py `prompt_ids_for`, engine/frontend/input_processor.py
`encode_prompt`) and both legs carry the ids as `prompt_token_ids`, so neither P nor D
tokenizes the prompt again; routing uses the same ids. A prompt the proxy cannot render (the
engine would refuse it, or the proxy has no tokenizer) goes without ids: the engine tokenizes.

The prefix view comes from proxy/prefix_index.py (KV events, or what was routed where).
Threading: event loop only, but for the tokenization of a long prompt (THREAD_MIN_CHARS), on
the "proxy-tokenize" threads. Policies are pure: they rank the backends they are handed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter

from proxy.backends import Backend, BackendPool, Lease
from proxy.config import ROUTING_POLICIES, EventSource
from proxy.kv_subscriber import EventSubscriber
from proxy.prefix_index import PrefixIndex

logger = logging.getLogger("pdserve.proxy")

POLICIES = ROUTING_POLICIES
DECODE_LOAD_TOKENS = 256  # a D leg in flight weighs as much as this many uncached tokens
# a prompt of more characters is tokenized on a worker thread (the encode releases the GIL),
# so the event loop relays other requests meanwhile (bench/results/tokenize_once.txt)
THREAD_MIN_CHARS = 4096


@dataclass(frozen=True)
class PromptTokens:
    """A request's prompt token ids as the engines will see them (None: unknown). `made_by`:
    the proxy made them with the engine's own code and this tokenizer (its fingerprint), so
    both legs carry them as `prompt_token_ids` (with `prompt_tokenizer`: an engine with
    another tokenizer encodes the text itself) and neither engine tokenizes the prompt."""

    ids: list[int] | None = None
    made_by: str | None = None

    @property
    def send(self) -> bool:
        return self.ids is not None and self.made_by is not None

    @property
    def for_legs(self) -> dict[str, Any] | None:
        """The fields both legs' bodies get (proxy/legs.py); None: none."""
        if not self.send:
            return None
        return {"prompt_token_ids": self.ids, "prompt_tokenizer": self.made_by}


NO_TOKENS = PromptTokens()


@dataclass
class RequestView:
    """What a policy knows of one request: its prompt tokens (None: unknown)."""

    tokens: list[int] | None
    index: PrefixIndex
    memo: dict[int, list[int]] = field(default_factory=dict)  # block size -> chain hashes
    _matched: dict[str, int] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) if self.tokens is not None else 0

    def matched(self, backend: Backend) -> int:
        """Leading prompt tokens `backend` holds (never the last one: it is always computed)."""
        if self.tokens is None:
            return 0
        if backend.url not in self._matched:
            got = self.index.matched_tokens(backend.url, self.tokens, self.memo)
            self._matched[backend.url] = min(got, self.num_tokens - 1)
        return self._matched[backend.url]

    def uncached(self, backend: Backend) -> int:
        return self.num_tokens - self.matched(backend)

    def fits(self, backend: Backend) -> bool:
        """Whether a D has the free KV blocks for the prompt's part it lacks (as its last
        health poll read them; unknown counts as room)."""
        free = backend.free_kv_blocks
        if free is None:
            return True
        bs = self.index.block_size(backend.url)
        return free * bs >= self.uncached(backend) + 1


@dataclass
class Route:
    """A policy's answer. `prefill`: P candidates, best first (the flow tries them in order
    when one's /kv_transfer/info fails); empty with `alone` set: D runs the request alone."""

    decode: Backend
    prefill: list[Backend]
    reason: str
    alone: bool = False


class RoutingPolicy(Protocol):
    name: str

    def route(self, view: RequestView, prefill: Sequence[Backend], decode: Sequence[Backend],
              ) -> Route:
        """Choose among the healthy backends, each list in round-robin order (the first is
        the next in turn); `decode` is never empty, `prefill` may be."""
        ...


def rotated(pool: BackendPool) -> list[Backend]:
    """The healthy backends, starting after the last one leased: a stable sort of this list
    sends ties round-robin."""
    n = len(pool.backends)
    order = [pool.backends[(pool.cursor + i) % n] for i in range(n)]
    return [b for b in order if b.healthy]


@dataclass
class LeastOutstanding:
    name: str = "least-outstanding"

    def route(self, view: RequestView, prefill: Sequence[Backend], decode: Sequence[Backend],
              ) -> Route:
        p = sorted(prefill, key=lambda b: b.outstanding)
        return Route(min(decode, key=lambda b: b.outstanding), p, "load")


@dataclass
class RoundRobin:
    name: str = "round-robin"

    def route(self, view: RequestView, prefill: Sequence[Backend], decode: Sequence[Backend],
              ) -> Route:
        return Route(decode[0], list(prefill), "round_robin")


@dataclass
class KVAware:
    disagg_min_tokens: int = 0
    prefill_max_outstanding: int = 0  # 0: a P is never saturated
    decode_max_outstanding: int = 0  # 0: D always has room
    name: str = "kv-aware"

    def route(self, view: RequestView, prefill: Sequence[Backend], decode: Sequence[Backend],
              ) -> Route:
        d = min(decode, key=lambda b: (not view.fits(b), view.uncached(b) + DECODE_LOAD_TOKENS
                                       * max(b.outstanding, b.running_requests or 0)))
        p = sorted(prefill, key=lambda b: (view.uncached(b) + b.pending_tokens, b.outstanding))
        if view.tokens is None:
            return Route(d, p, "no_tokens")
        d_room = view.fits(d) and (not self.decode_max_outstanding
                                   or d.outstanding < self.decode_max_outstanding)
        if view.uncached(d) < self.disagg_min_tokens and d_room:
            return Route(d, [], "short_uncached", alone=True)
        if p and self.prefill_max_outstanding and d_room and all(
                b.outstanding >= self.prefill_max_outstanding for b in p):
            return Route(d, [], "prefill_saturated", alone=True)
        return Route(d, p, "prefix" if p and view.matched(p[0]) else "load")


class RoutingMetrics:
    """pdserve:proxy_routing_decisions_total{policy,reason}, _route_pairs_total{prefill,
    decode} (prefill "" = D alone), _prefix_matched_tokens_total{url,role} and
    _prompt_tokens_total{url,role} (their ratio: the hit rate the routing found),
    _computed_prompt_tokens_total{url,role} (the prefill work the routing left), and the KV
    event consumer's _kv_events_total{url,outcome} and _kv_event_resyncs_total{url,outcome}."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.decisions = Counter("pdserve:proxy_routing_decisions",
                                 "Routing decisions by policy and reason.",
                                 ["policy", "reason"], registry=r)
        self.pairs = Counter("pdserve:proxy_route_pairs",
                             "Requests by the pair chosen (prefill empty: D alone).",
                             ["prefill", "decode"], registry=r)
        self.matched = Counter("pdserve:proxy_prefix_matched_tokens",
                               "Prompt tokens the chosen backend held in its prefix cache "
                               "(as the proxy's index saw it).", ["url", "role"], registry=r)
        self.computed = Counter("pdserve:proxy_computed_prompt_tokens",
                                "Prompt tokens the chosen engine computes (those its cache "
                                "lacks, as the proxy's index sees it): P's for a pair, D's for "
                                "D alone.", ["url", "role"], registry=r)
        self.prompt = Counter("pdserve:proxy_prompt_tokens",
                              "Prompt tokens routed to the backend.", ["url", "role"],
                              registry=r)
        self.kv_events = Counter("pdserve:proxy_kv_events",
                                 "KV event batches from engine publishers by outcome "
                                 "(applied, replayed, malformed).", ["url", "outcome"],
                                 registry=r)
        self.kv_event_resyncs = Counter("pdserve:proxy_kv_event_resyncs",
                                        "Sequence gaps by outcome (replayed, failed, "
                                        "restart).", ["url", "outcome"], registry=r)


def make_policy(name: str, *, disagg_min_tokens: int = 0, prefill_max_outstanding: int = 0,
                decode_max_outstanding: int = 0) -> RoutingPolicy:
    if name == "kv-aware":
        return KVAware(disagg_min_tokens, prefill_max_outstanding, decode_max_outstanding)
    if name == "least-outstanding":
        return LeastOutstanding()
    if name == "round-robin":
        return RoundRobin()
    raise ValueError(f"routing must be one of {POLICIES}, got {name!r}")


class Router:
    """The flow's one handle on routing: tokens once, the policy's route, leases, metrics."""

    def __init__(self, policy: RoutingPolicy, prefill: BackendPool, decode: BackendPool,
                 index: PrefixIndex, metrics: RoutingMetrics, tokenizer: Any = None) -> None:
        self.policy = policy
        self.prefill = prefill
        self.decode = decode
        self.index = index
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.fingerprint: str | None = None  # the tokenizer's, sent with the ids it made
        if tokenizer is not None:
            from engine.frontend.input_processor import tokenizer_fingerprint

            self.fingerprint = tokenizer_fingerprint(tokenizer)
        self._pool: ThreadPoolExecutor | None = None  # made at the first long prompt

    def route(self, tokens: PromptTokens) -> tuple[Route, RequestView] | None:
        """The route of one request (its `prompt_tokens`); None when no D is healthy."""
        view = RequestView(tokens.ids, self.index)
        decode = rotated(self.decode)
        if not decode:
            return None
        route = self.policy.route(view, rotated(self.prefill), decode)
        self.metrics.decisions.labels(policy=self.policy.name, reason=route.reason).inc()
        return route, view

    def lease_prefill(self, route: Route, view: RequestView, exclude: Sequence[Backend] = ()
                      ) -> Lease | None:
        skip = set(map(id, exclude))
        for b in route.prefill:
            if b.healthy and id(b) not in skip:
                self._count(b, "prefill", view)
                if view.tokens is not None:
                    self.metrics.computed.labels(url=b.url, role="prefill").inc(view.uncached(b))
                return self.prefill.lease(b, view.uncached(b))
        return None

    def lease_decode(self, route: Route, view: RequestView, prefill: Lease | None) -> Lease | None:
        lease = self.take_decode(route)
        if lease is not None:
            self.account_decode(view, lease, prefill)
        return lease

    def take_decode(self, route: Route) -> Lease | None:
        """The route's D, leased now: a flow leases it before it awaits anything, so requests
        arriving together see each other's leases and spread over the decode backends."""
        b = route.decode if route.decode.healthy else None
        return self.decode.lease(b) if b is not None else self.decode.choose()

    def account_decode(self, view: RequestView, lease: Lease, prefill: Lease | None) -> None:
        """The metrics of a D leased with `take_decode`, once its pair is known."""
        if prefill is None and view.tokens is not None:  # D alone computes what it lacks
            self.metrics.computed.labels(url=lease.url, role="decode").inc(
                view.uncached(lease.backend))
        self._count(lease.backend, "decode", view)
        self.metrics.pairs.labels(prefill=prefill.url if prefill else "",
                                  decode=lease.url).inc()

    def _count(self, b: Backend, role: str, view: RequestView) -> None:
        if view.tokens is None:
            return
        self.metrics.matched.labels(url=b.url, role=role).inc(view.matched(b))
        self.metrics.prompt.labels(url=b.url, role=role).inc(view.num_tokens)
        self.index.routed_to(b.url, view.tokens, view.memo)

    async def prompt_tokens(self, body: dict[str, Any], chat: bool) -> PromptTokens:
        """The request's prompt tokens, made once per request (the flow keeps them for its
        retries); a long prompt is tokenized on a worker thread."""
        if self.tokenizer is None:
            return NO_TOKENS
        if _prompt_chars(body, chat) < THREAD_MIN_CHARS:
            return self.tokenize(body, chat)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(2, thread_name_prefix="proxy-tokenize")
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, self.tokenize, body, chat, True)

    def tokenize(self, body: dict[str, Any], chat: bool, release_gil: bool = False
                 ) -> PromptTokens:
        """The prompt's token ids as the engine will see them (NO_TOKENS: unknown)."""
        if self.tokenizer is None:
            return NO_TOKENS
        given = body.get("prompt_token_ids")
        if given is not None:  # the client's own: passed on as sent, the engines check them
            ok = isinstance(given, list) and given and all(type(t) is int for t in given)
            return PromptTokens(list(given)) if ok else NO_TOKENS
        try:
            if chat:
                from engine.server.chat import prompt_ids_for

                return PromptTokens(prompt_ids_for(self.tokenizer, body,
                                                   release_gil=release_gil), self.fingerprint)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
                return PromptTokens(list(prompt))
            if isinstance(prompt, str) and prompt:
                from engine.frontend.input_processor import encode_prompt

                return PromptTokens(encode_prompt(self.tokenizer, prompt,
                                                  release_gil=release_gil), self.fingerprint)
        except Exception as exc:  # the engine will answer the client's mistake itself
            logger.debug("routing: prompt not tokenized: %s", exc)
        return NO_TOKENS


def _prompt_chars(body: dict[str, Any], chat: bool) -> int:
    """About how much text the prompt holds (it picks the thread, nothing else)."""
    if not chat:
        prompt = body.get("prompt")
        return len(prompt) if isinstance(prompt, str) else sum(
            len(p) for p in prompt if isinstance(p, str)) if isinstance(prompt, list) else 0
    total = 0
    for m in body.get("messages") or ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(str(part.get("text", ""))) for part in content
                         if isinstance(part, dict))
    return total


def build_router(config: Any, prefill: BackendPool, decode: BackendPool,
                 registry: CollectorRegistry) -> tuple[Router, list[EventSubscriber]]:
    """The Router of a ProxyConfig and one KV event subscriber per --kv-events (not started)."""
    index = PrefixIndex()
    metrics = RoutingMetrics(registry)
    policy = make_policy(config.routing, disagg_min_tokens=config.disagg_min_tokens,
                         prefill_max_outstanding=config.prefill_max_outstanding,
                         decode_max_outstanding=config.decode_max_outstanding)
    tokenizer = None
    if config.tokenizer is not None:
        from engine.models.formats import load_tokenizer

        tokenizer = load_tokenizer(config.tokenizer)
    subscribers = [EventSubscriber(EventSource.parse(text), index, metrics,
                                   topic=config.kv_events_topic) for text in config.kv_events]
    return Router(policy, prefill, decode, index, metrics, tokenizer), subscribers
