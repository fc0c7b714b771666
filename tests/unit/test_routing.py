"""Routing policies (proxy/routing.py) on plain data: the prefix index, backends, no processes."""

from __future__ import annotations

import asyncio
import http.server
import threading

import httpx
import pytest

from engine.kv_events import BlockStored
from proxy.backends import LOAD_POLL_INTERVAL_S, Backend, BackendPool, HealthMonitor
from proxy.metrics import ProxyMetrics
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


def test_kv_aware_chooses_no_d_without_free_kv_for_the_prompt_while_another_has_room():
    p0, d0, d1 = _backends("http://p0", "http://d0", "http://d1")
    turn = HISTORY + list(range(500, 540))  # D0 holds 160 tokens of 200, D1 none
    index = _index_holding("http://d0", HISTORY)
    policy = KVAware()
    assert policy.route(RequestView(turn, index), [p0], [d0, d1]).decode is d0
    d0.free_kv_blocks = 2  # 32 tokens of room: not enough for the 40 it lacks
    assert policy.route(RequestView(turn, index), [p0], [d0, d1]).decode is d1
    d0.free_kv_blocks, d1.free_kv_blocks = 3, 0  # 48 tokens fit; D1 has none
    assert policy.route(RequestView(turn, index), [p0], [d0, d1]).decode is d0
    # running requests the health poll read (other proxies' legs) weigh as legs in flight
    d0.free_kv_blocks = d1.free_kv_blocks = None
    d0.running_requests = 3
    assert policy.route(RequestView(turn, index), [p0], [d0, d1]).decode is d1
    # a short follow-up does not run alone on a D without the room to prefill it
    d0.running_requests, d1.free_kv_blocks = None, 0
    alone = KVAware(disagg_min_tokens=64)
    short = RequestView(HISTORY + [7] * 20, index)
    assert alone.route(short, [p0], [d0, d1]).alone is True
    d0.free_kv_blocks = 1  # 16 tokens: the 20 it lacks do not fit
    route = alone.route(short, [p0], [d0, d1])
    assert route.alone is False and route.prefill == [p0]


class _Engine(http.server.BaseHTTPRequestHandler):
    metrics = ""
    hits: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.hits.append(self.path)
        body = (self.metrics if self.path == "/metrics" else "ok").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_the_health_poll_reads_each_d_free_kv_blocks_and_running_requests():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    metrics = ProxyMetrics()
    prefill, decode = BackendPool("prefill", [url], metrics), BackendPool("decode", [url], metrics)
    d = decode.backends[0]

    async def poll(text: str) -> None:
        _Engine.metrics = text
        async with httpx.AsyncClient() as client:
            await HealthMonitor([prefill, decode], client, interval=60,
                                timeout=5).check_once()
    try:
        _Engine.hits.clear()
        asyncio.run(poll('pdserve:num_free_kv_blocks{engine="0"} 7.0\n'
                         'pdserve:num_free_kv_blocks{engine="1"} 5.0\n'
                         '# HELP pdserve:num_requests_running x\n'
                         'pdserve:num_requests_running{engine="0"} 2.0\n'))
        assert (d.free_kv_blocks, d.running_requests, d.healthy) == (12, 2, True)
        assert sorted(_Engine.hits) == ["/health", "/health", "/metrics"]  # D's only
        assert prefill.backends[0].free_kv_blocks is None
        asyncio.run(poll("pdserve:num_free_kv_blocks{engine=\"0\"} 1.0\n"))
        assert d.free_kv_blocks == 12 and _Engine.hits.count("/metrics") == 1  # not yet due
        d.load_read_at -= LOAD_POLL_INTERVAL_S  # the next poll is due
        asyncio.run(poll("pdserve:num_free_kv_blocks{engine=\"0\"} nan\n"))  # malformed
        assert (d.free_kv_blocks, d.running_requests, d.healthy) == (None, None, True)
    finally:
        server.shutdown()
        server.server_close()


def test_disagg_min_tokens_defaults_to_the_measured_value_for_kv_aware_only():
    import argparse

    from proxy.cli import add_args, config_from_args
    from proxy.config import DISAGG_MIN_TOKENS

    def config(*argv: str):
        parser = argparse.ArgumentParser()
        add_args(parser)
        return config_from_args(parser.parse_args(
            ["--prefill", "http://p", "--decode", "http://d", *argv]))

    assert config().disagg_min_tokens == DISAGG_MIN_TOKENS  # kv-aware is the default
    assert config("--disagg-min-tokens", "48").disagg_min_tokens == 48
    for policy in ("least-outstanding", "round-robin"):  # no threshold without kv-aware
        assert config("--routing", policy).disagg_min_tokens == 0
    with pytest.raises(ValueError, match="disagg_min_tokens"):  # no threshold there
        config("--routing", "round-robin", "--disagg-min-tokens", "48")
