"""Routing policies (proxy/routing.py) on plain data: the prefix index, backends, no processes."""

from __future__ import annotations

from engine.kv_events import BlockStored
from proxy.backends import Backend
from proxy.prefix_index import PrefixIndex, chain_hashes
from proxy.routing import KVAware, LeastOutstanding, RequestView

HISTORY = list(range(10, 10 + 160))  # ten blocks of 16


def _index_holding(url: str, tokens: list[int]) -> PrefixIndex:
    index = PrefixIndex()
    chain = chain_hashes(tokens, 16)
    index.apply(url, 0, [BlockStored(chain, None, tokens[:len(chain) * 16], 16)])
    return index


def _backends(*urls: str) -> list[Backend]:
    return [Backend(u, "prefill", healthy=True) for u in urls]


def test_kv_aware_sends_a_turn_to_the_p_holding_its_history_unless_it_is_overloaded():
    p0, p1 = _backends("http://p0", "http://p1")
    (d,) = _backends("http://d")
    turn = HISTORY + list(range(500, 540))
    index = _index_holding("http://p1", HISTORY)
    route = KVAware().route(RequestView(turn, index), [p0, p1], [d])
    assert route.prefill[0] is p1 and route.reason == "prefix" and not route.alone
    p1.pending_tokens, p1.outstanding = 1000, 3  # a long prompt queued on P1: P0 is sooner
    route = KVAware().route(RequestView(turn, index), [p0, p1], [d])
    assert route.prefill[0] is p0
    # least-outstanding does not look at the caches
    p1.pending_tokens, p1.outstanding = 0, 0
    assert LeastOutstanding().route(RequestView(turn, index), [p0, p1], [d]).prefill[0] is p0


def test_kv_aware_runs_d_alone_when_d_lacks_few_tokens_or_every_p_is_saturated():
    p0, p1 = _backends("http://p0", "http://p1")
    (d,) = _backends("http://d")
    index = _index_holding("http://d", HISTORY)
    policy = KVAware(disagg_min_tokens=32, prefill_max_outstanding=2)
    short = RequestView(HISTORY + [7] * 20, index)  # D lacks 20 tokens
    assert (policy.route(short, [p0, p1], [d]).reason, policy.route(short, [p0, p1], [d]).alone
            ) == ("short_uncached", True)
    long = RequestView(HISTORY + [7] * 40, index)
    assert policy.route(long, [p0, p1], [d]).alone is False
    p0.outstanding = p1.outstanding = 2
    route = policy.route(long, [p0, p1], [d])
    assert (route.reason, route.alone, route.prefill) == ("prefill_saturated", True, [])
    # without tokens: load alone, never D alone
    assert policy.route(RequestView(None, index), [p0, p1], [d]).reason == "no_tokens"


def test_routed_prompts_stand_in_for_events_on_backends_that_publish_none():
    index = PrefixIndex()
    memo: dict[int, list[int]] = {}
    index.routed_to("http://p0", HISTORY, memo)
    assert index.matched_tokens("http://p0", HISTORY + [1, 2, 3], {}) == 160
    index.expect_events("http://p1")
    index.routed_to("http://p1", HISTORY, memo)  # events are the truth there
    assert index.matched_tokens("http://p1", HISTORY, {}) == 0
