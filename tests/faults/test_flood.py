"""State created by remote input stays bounded (DESIGN invariant 7), played by an attacker.

Without a KV secret (the vLLM-compatible mode) anyone who reaches P's side channel can load
P's agent and send notifications. A rogue agent sends 1,000 registrations naming 200 dead
addresses (ports that refuse, and listeners that accept and never answer). P must keep its
tables within their caps and its memory bounded, and a real D that first contacts P in the
middle of the flood must not wait behind the dead addresses' handshakes.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import statistics
import time

import httpx
import torch
from fault_kit import cluster, legs, post, processes, prompts, table, text_of, wait_for
from pd_harness import engine_stats

from kvconnector import wire
from kvconnector.handshake import fetch_peer_metadata
from kvconnector.nixl import NixlTransport
from kvconnector.peers import MAX_FIRST_CONTACTS

NUM_REGS, NUM_DEAD, NUM_SILENT = 1000, 150, 50


def _pair_seconds(dep, d, prompt: list[int], tid: str) -> tuple[str, float]:
    p_leg, d_leg = legs(dep, prompt, tid, max_tokens=1)

    async def run() -> tuple[str, float]:
        started = time.monotonic()
        d_task = asyncio.create_task(post(d.url, d_leg, tid))
        assert (await post(dep.p.url, p_leg, tid)).status_code == 200
        text = text_of(await d_task)
        return text, time.monotonic() - started

    return asyncio.run(run())


def _dead_addresses(stack: contextlib.ExitStack) -> list[tuple[str, int]]:
    addrs = []
    for _ in range(NUM_DEAD):  # bound, then closed: connections are refused
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            addrs.append(s.getsockname())
    for _ in range(NUM_SILENT):  # listening, never answering: a handshake times out
        s = stack.enter_context(socket.socket())
        s.bind(("127.0.0.1", 0))
        s.listen(512)
        addrs.append(s.getsockname())
    return addrs


def _rogue_regs(addrs: list[tuple[str, int]], p_info: dict) -> list[bytes]:
    return [wire.encode_push_reg(wire.PushReg(
        request_id=f"bogus-{i}", transfer_id=f"bogus-tid-{i}", decode_engine_id="rogue",
        decode_host=addrs[i % len(addrs)][0], decode_port=addrs[i % len(addrs)][1],
        decode_tp_size=1, local_block_ids=[list(range(16))], first_block_index=0,
        remote_engine_id=p_info["engine_id"], remote_host=p_info["kv_host"],
        remote_port=p_info["kv_port"], remote_tp_size=1, **_digest_field()))
        for i in range(NUM_REGS)]


def _digest_field() -> dict:
    return {"prompt_digest": "0" * 32} if "prompt_digest" in wire.PushReg.__struct_fields__ \
        else {}


def test_a_registration_flood_naming_dead_addresses_stays_bounded(tiny_model, reference):
    with cluster(tiny_model, name="flood", d_extras=[{}, {}], with_proxy=False) as dep, \
            contextlib.ExitStack() as stack:
        d0, d1 = dep.decodes
        p_info = httpx.get(f"{dep.p.url}/kv_transfer/info", timeout=5).json()
        core = max(processes(dep.p), key=lambda p: p.memory_info().rss)
        ps = prompts(8, seed=601, lo=60, hi=60)
        # Baseline: D0 (already known to P after its first request) before the flood.
        _pair_seconds(dep, d0, ps[0], "warm")
        before = [_pair_seconds(dep, d0, p, f"before-{i}")[1] for i, p in enumerate(ps[1:4])]
        rss_before = core.memory_info().rss

        meta = fetch_peer_metadata(p_info["kv_host"], p_info["kv_port"], None, 5.0)
        cache = torch.zeros(2 * meta.bytes_per_block, dtype=torch.uint8)
        rogue = NixlTransport("rogue-agent", cache.view(2, -1), meta.bytes_per_block)
        stack.callback(rogue.shutdown)
        agent = rogue.add_peer(meta)
        for msg in _rogue_regs(_dead_addresses(stack), p_info):
            rogue.send_notif(agent, msg)


        def taken_in() -> bool:
            rogue.get_new_notifs()  # drives the rogue agent's sends (no progress thread)
            return engine_stats(dep.p)["kv_connector"].get(
                "kv_push_registrations_received_total", 0) >= NUM_REGS + 4

        wait_for(taken_in, 30, "P to take in the flood")

        # D1 contacts P for the first time while P's handshakes with the dead hang.
        text, first = _pair_seconds(dep, d1, ps[4], "first-contact")
        assert text == reference([ps[4]], 1)[0]
        during = [_pair_seconds(dep, d1, p, f"during-{i}")[1] for i, p in enumerate(ps[5:8])]
        st = engine_stats(dep.p)
        assert first < 3.0, f"D1's first request waited {first:.2f}s behind dead handshakes"
        ratio = statistics.median(during) / statistics.median(before)
        assert ratio < 3.0, (before, during)
        assert st["p_regs"] <= NUM_REGS and st["p_outbox"] <= NUM_REGS
        assert st["peers_ready"] + st["peers_pending"] + st["peers_failed"] <= (
            NUM_DEAD + NUM_SILENT + 2)
        assert st["peers_pending"] <= MAX_FIRST_CONTACTS
        grown = (core.memory_info().rss - rss_before) / 2**20
        assert grown < 64, f"P's core grew by {grown:.0f} MiB"
        # Every dead address is given up on; the flood's state ages out with the ttl.
        wait_for(lambda: table(dep.p, "peers_pending") == 0, 30,
                 "P's handshakes with the dead addresses to end")
        med_before, med_during = statistics.median(before), statistics.median(during)
        print(f"first contact {first * 1e3:.0f} ms; median pair before {med_before * 1e3:.0f} "
              f"ms, during {med_during * 1e3:.0f} ms (ratio {ratio:.2f}); "
              f"P core RSS +{grown:.1f} MiB")
