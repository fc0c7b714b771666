"""A P frozen (SIGSTOP) past D's watchdog and quarantine, then thawed (SIGCONT), must not
WRITE into blocks D has since given to other requests."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest
from fault_kit import (
    cluster,
    kv_stat,
    legs,
    metric,
    plain,
    post,
    post_sync,
    prompts,
    signal_all,
    table,
    text_of,
    wait_for,
)
from pd_harness import assert_no_leaks, engine_stats

LEASE, TTL = 2.0, 5.0
NUM_BLOCKS = 32  # small, so a handful of later requests reuse every block D ever held
FILLER_TOKENS = 16


@pytest.fixture(scope="module")
def dep(tiny_model: str):
    # D1 loses its PUSH_CANCELs: then only P's own ttl check stands between a thawed P and
    # D's reused blocks.
    with cluster(tiny_model, num_blocks=NUM_BLOCKS, with_proxy=False, name="stall",
                 extra={"kv_lease_duration": LEASE, "push_registration_timeout": TTL},
                 d_extras=[{}, {"fault_injection": {"drop_notif": ["PUSH_CANCEL"]}}]) as d:
        yield d


def _pair(dep, d, prompt: list[int], tid: str) -> str:
    p_leg, d_leg = legs(dep, prompt, tid)

    async def run() -> str:
        d_task = asyncio.create_task(post(d.url, d_leg, tid))
        assert (await post(dep.p.url, p_leg, tid)).status_code == 200
        return text_of(await d_task)

    return asyncio.run(run())


def _kv(server, prompt: list[int]) -> list[str]:
    return httpx.post(f"{server.url}/debug/prompt_kv", json={"prompt_token_ids": prompt},
                      timeout=10).json()["blocks"]


@pytest.mark.parametrize("d_index", [0, 1], ids=["cancel_delivered", "cancel_lost"])
def test_thawed_prefill_never_writes_into_blocks_d_reused(dep, reference, d_index):
    d = dep.decodes[d_index]
    seed = 200 + 10 * d_index
    warm = prompts(1, seed=seed + 1, lo=40, hi=40)[0]
    assert _pair(dep, d, warm, f"tid-warm-{d_index}") == reference([warm])[0]  # D knows P
    victim = prompts(1, seed=seed + 2, lo=100, hi=100)[0]
    fillers = prompts(10, seed=seed + 3, lo=56, hi=56)
    writes = metric(dep.p, "pdserve:kv_push_writes_total")
    p_leg, d_leg = legs(dep, victim, f"tid-frozen-{d_index}")
    fail_sent = kv_stat(dep.p, "kv_push_fail_sent_total")

    signal_all(dep.p, signal.SIGSTOP)
    try:
        async def frozen() -> tuple[str, asyncio.Task]:
            # P's leg waits in the frozen P's socket; D registers, gives up, recomputes.
            p_task = asyncio.create_task(post(dep.p.url, p_leg, "frozen", timeout=120))
            out = await post(d.url, d_leg, "frozen")
            return text_of(out), p_task

        async def scenario() -> None:
            text, p_task = await frozen()
            assert text == reference([victim])[0]
            # Quarantine over (no ack can come from a frozen P): D frees the blocks ...
            await asyncio.to_thread(wait_for, lambda: table(d, "d_quarantine") == 0
                                    and engine_stats(d)["num_free_blocks"] == NUM_BLOCKS,
                                    4 * TTL, "D's quarantine to end")
            # ... and hands every one of them to other requests.
            for i, f in enumerate(fillers):
                out = await post(d.url, plain(f, FILLER_TOKENS), f"filler-{i}")
                assert out.status_code == 200, out.text
            cached = {i: _kv(d, f) for i, f in enumerate(fillers)}
            cached = {i: kv for i, kv in cached.items() if kv}
            assert sum(len(kv) for kv in cached.values()) >= NUM_BLOCKS // 2
            signal_all(dep.p, signal.SIGCONT)
            assert (await p_task).status_code == 200  # P prefilled the victim after all
            await asyncio.to_thread(wait_for, lambda: table(dep.p, "p_staged") == 0
                                    and table(dep.p, "p_regs") == 0, 3 * TTL,
                                    "P to settle the stale registration")
            time.sleep(0.5)  # a WRITE, had one been posted, has landed by now
            assert metric(dep.p, "pdserve:kv_push_writes_total") == writes
            if d_index == 1:  # no cancel came: P's ttl check refused the stale PUSH_REG
                assert kv_stat(dep.p, "kv_push_fail_sent_total") > fail_sent
            for i, kv in cached.items():
                assert _kv(d, fillers[i]) == kv, f"filler {i}'s cached KV was overwritten"
            outs = await asyncio.gather(*(post(d.url, plain(f, FILLER_TOKENS), f"again-{i}")
                                          for i, f in enumerate(fillers)))
            assert [text_of(o) for o in outs] == reference(fillers, FILLER_TOKENS)

        asyncio.run(scenario())
    finally:
        signal_all(dep.p, signal.SIGCONT)
    # The pair works again once P is back.
    again = prompts(1, seed=seed + 4, lo=60, hi=60)[0]
    remote = metric(d, "pdserve:kv_remote_prefill_tokens_total")
    wait_for(lambda: post_sync(dep.p.url, plain(again, 1), "ping").status_code == 200, 30,
             "P to answer again")
    # D declared the frozen P dead; it takes P back once P's side channel answers a probe
    # (or drops it once idle, and handshakes afresh on the next request).
    wait_for(lambda: table(d, "peers_failed") == 0, 4 * TTL, "D to stop holding P as failed")
    assert _pair(dep, d, again, f"tid-after-thaw-{d_index}") == reference([again])[0]
    assert metric(d, "pdserve:kv_remote_prefill_tokens_total") > remote
    assert_no_leaks(dep.engines, timeout=4 * TTL)
