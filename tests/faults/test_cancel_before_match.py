"""P prefilled and staged a transfer's blocks; D's request ends before any registration of
it took them (the client went away while D's PUSH_REG was lost, or while D's request still
queued for blocks). P frees the staged blocks as soon as D's cancel reaches it, not a lease
later, and no lease expires; an honest request beside it is answered.

D1 loses every PUSH_REG it sends (fault injection), so its requests wait for a WRITE that
never comes; D0 is healthy. Against the old code P held the blocks until its lease ended
(`kv_lease_expired_total` +1): a cancel with no registration held only tombstoned the transfer,
and a request that left D while queued sent P nothing at all.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from fault_kit import both_legs, cluster, kv_stat, legs, post, prompts, table, text_of, wait_for
from pd_harness import assert_no_leaks, engine_stats

pytestmark = pytest.mark.timeout(240)

LEASE = 8.0  # D's heartbeats (every LEASE / 6) keep P's blocks while D waits
TTL = 8.0
D_BLOCKS = 32  # 512 tokens on each D
FILLER_TOKENS = 400  # 25 blocks: a D1 request waiting for a WRITE that never comes
QUEUED_TOKENS = 200  # 13 blocks: does not fit beside the filler, so it queues
LOSES_REGS = {"fault_injection": {"drop_notif": ["PUSH_REG"]}}
EXPIRED = "kv_lease_expired_total"


@pytest.fixture(scope="module")
def dep(tiny_model: str):
    with cluster(tiny_model, num_blocks=D_BLOCKS, name="cancel-before-match",
                 p_args=("--num-kv-blocks", "256"), d_extras=[{}, LOSES_REGS],
                 extra={"kv_lease_duration": LEASE, "push_registration_timeout": TTL},
                 with_proxy=False) as d:
        yield d


async def _stream(url: str, body: dict, rid: str) -> None:
    async with httpx.AsyncClient(timeout=60) as c, c.stream(
            "POST", f"{url}/v1/completions", json={**body, "stream": True},
            headers={"X-Request-Id": rid}) as r:
        async for _ in r.aiter_raw():
            pass


def _p_staged(dep) -> bool:
    st = engine_stats(dep.p)
    return st["p_staged"] == 1 and st["num_free_blocks"] < st["num_kv_blocks"]


def _p_freed(dep) -> bool:
    st = engine_stats(dep.p)
    return st["p_staged"] == 0 and st["num_free_blocks"] == st["num_kv_blocks"]


def _stage_on_p(dep, prompt: list[int], tid: str) -> dict:
    """P prefills the transfer and stages its blocks under lease; returns the D leg."""
    p_leg, d_leg = legs(dep, prompt, tid)
    assert asyncio.run(post(dep.p.url, p_leg, tid)).status_code == 200
    wait_for(lambda: _p_staged(dep), 10, "P to stage the blocks")
    return d_leg


def _cancel_when(dep, d_leg: dict, rid: str, ready) -> float:
    """Stream the D leg to D1, hang up once `ready()`; how long P then held its blocks."""
    async def run() -> float:
        task = asyncio.create_task(_stream(dep.decodes[1].url, d_leg, rid))
        await asyncio.to_thread(wait_for, ready, 20, f"{rid} to reach its state on D1")
        task.cancel()  # the client goes away
        gone = time.monotonic()
        await asyncio.to_thread(wait_for, lambda: _p_freed(dep), 3 * LEASE,
                                "P to free the staged blocks")
        return time.monotonic() - gone

    return asyncio.run(run())


def _honest(dep, reference, seed: int) -> None:
    prompt = prompts(1, seed=seed, lo=60, hi=60)[0]
    out, _ = both_legs(dep, dep.decodes[0], prompt, f"tid-honest-{seed}")
    assert text_of(out) == reference([prompt])[0]


def test_a_cancel_before_ps_blocks_were_matched_frees_them_at_once(dep, reference):
    """D1's PUSH_REG is lost: P holds the staged blocks (D1's heartbeats keep the lease);
    the client hangs up, D1 cancels: P frees them at once and acknowledges nothing late."""
    expired = kv_stat(dep.p, EXPIRED)
    d_leg = _stage_on_p(dep, prompts(1, seed=901, lo=100, hi=100)[0], "tid-lost-reg")
    held = _cancel_when(dep, d_leg, "lost-reg", lambda: table(dep.decodes[1], "d_waiting") == 1)
    assert held < LEASE / 2, f"P held the blocks {held:.1f}s after D's cancel"
    assert kv_stat(dep.p, EXPIRED) == expired  # freed by the cancel, not by the lease
    _honest(dep, reference, 902)
    assert_no_leaks(dep.engines, timeout=3 * TTL)  # D1 quarantines until its deadline


def test_a_request_leaving_d_while_queued_frees_ps_blocks_at_once(dep, reference):
    """D1's blocks are held by a filler that waits for a WRITE (its PUSH_REG lost); the next
    D leg queues for blocks, heartbeating P, which holds its staged blocks. The client hangs
    up: D1 tells P (PUSH_CANCEL without a registration) and P frees them at once."""
    expired = kv_stat(dep.p, EXPIRED)
    filler = prompts(1, seed=903, lo=FILLER_TOKENS, hi=FILLER_TOKENS)[0]
    _, filler_leg = legs(dep, filler, "tid-filler")
    d_leg = _stage_on_p(dep, prompts(1, seed=904, lo=QUEUED_TOKENS, hi=QUEUED_TOKENS)[0],
                        "tid-queued")

    async def run() -> tuple[float, httpx.Response]:
        filler_task = asyncio.create_task(post(dep.decodes[1].url, filler_leg, "filler"))
        await asyncio.to_thread(wait_for, lambda: table(dep.decodes[1], "d_waiting") == 1, 20,
                                "the filler to hold D1's blocks")
        held = await asyncio.to_thread(
            _cancel_when, dep, d_leg, "queued",
            lambda: table(dep.decodes[1], "d_queued") == 1)
        return held, await filler_task

    held, filler_out = asyncio.run(run())
    assert held < LEASE / 2, f"P held the blocks {held:.1f}s after the request left D"
    assert kv_stat(dep.p, EXPIRED) == expired
    assert text_of(filler_out) == reference([filler])[0]  # recomputed after its watchdog
    _honest(dep, reference, 905)
    assert_no_leaks(dep.engines, timeout=3 * TTL)
