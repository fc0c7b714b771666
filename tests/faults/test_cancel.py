"""D gives up on a registered transfer (the client went away): its blocks stay quarantined
until P acknowledges the PUSH_CANCEL (or the WRITE's completion shows it landed), then are
freed; nothing P sends later lands in them."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest
from fault_kit import (
    cluster,
    legs,
    metric,
    plain,
    post,
    prompts,
    table,
    text_of,
    wait_for,
)
from pd_harness import assert_no_leaks, engine_stats

TTL = 6.0
ACK_DELAY = 1.5
P_FAULTS = {"delay_notif": {"PUSH_CANCEL_ACK": ACK_DELAY, "COMPLETION": 1.0},
            "delay_write_completion_s": 2.5}


@pytest.fixture(scope="module")
def dep(tiny_model: str):
    with cluster(tiny_model, name="cancel",
                 extra={"kv_lease_duration": 2.0, "push_registration_timeout": TTL},
                 p_extra={"fault_injection": P_FAULTS}) as d:
        yield d


async def _stream(url: str, body: dict, rid: str) -> None:
    async with httpx.AsyncClient(timeout=60) as c, c.stream(
            "POST", f"{url}/v1/completions", json=body, headers={"X-Request-Id": rid}) as r:
        async for _ in r.aiter_raw():
            pass


def _quarantined(d) -> bool:
    st = engine_stats(d)
    return st["d_quarantine"] == 1 and st["num_free_blocks"] < st["num_kv_blocks"]


def _freed(d) -> bool:
    st = engine_stats(d)
    return st["d_quarantine"] == 0 and st["num_free_blocks"] == st["num_kv_blocks"]


def _check_no_corruption(dep, reference, seed: int) -> None:
    """A fresh transfer and a replay over D's cached blocks give the reference tokens."""
    ps = prompts(4, seed=seed, lo=60, hi=100)

    async def run() -> list[str]:
        outs = await asyncio.gather(*(post(dep.proxy.url, plain(p), f"check-{seed}-{i}")
                                      for i, p in enumerate(ps)))
        again = await asyncio.gather(*(post(dep.d.url, plain(p), f"replay-{seed}-{i}")
                                       for i, p in enumerate(ps)))
        return [text_of(o) for o in outs + again]

    assert asyncio.run(run()) == reference(ps) * 2


@pytest.mark.parametrize("tid", ["tid-abort-early", None], ids=["transfer_id", "no_id"])
def test_abort_after_registration_quarantines_until_the_cancel_ack(dep, reference, tid):
    """Without a transfer_id (vLLM's push protocol) cancel, ACK and P's refusal to write
    work by request id."""
    prompt = prompts(1, seed=301 if tid else 303, lo=90, hi=90)[0]
    p_leg, d_leg = legs(dep, prompt, tid, stream=True)
    rid = "abort-early" if tid else "abort-early-no-id"
    # P counts a WRITE when its (injected) slow completion shows up; let earlier ones finish.
    wait_for(lambda: table(dep.p, "p_inflight") == 0, 10, "earlier WRITEs to finish")
    received = metric(dep.p, "pdserve:kv_push_registrations_received_total")
    writes = metric(dep.p, "pdserve:kv_push_writes_total")

    async def run() -> float:
        task = asyncio.create_task(_stream(dep.d.url, d_leg, rid))
        await asyncio.to_thread(
            wait_for, lambda: metric(dep.p, "pdserve:kv_push_registrations_received_total")
            > received, 20, "P to receive the registration")
        task.cancel()  # the client disconnects before P has prefilled anything
        aborted = time.monotonic()
        await asyncio.to_thread(wait_for, lambda: _quarantined(dep.d), 5, "the quarantine")
        await asyncio.to_thread(wait_for, lambda: _freed(dep.d), 2 * TTL, "the blocks freed")
        return time.monotonic() - aborted

    held = asyncio.run(run())
    assert ACK_DELAY * 0.8 <= held < 2 * TTL, f"blocks held {held:.1f}s"
    # P's leg still comes; P must not write into blocks D has freed.
    assert asyncio.run(post(dep.p.url, p_leg, rid)).status_code == 200
    wait_for(lambda: table(dep.p, "p_staged") == 0, 10, "P to drop its blocks")
    assert metric(dep.p, "pdserve:kv_push_writes_total") == writes
    assert_no_leaks(dep.engines)
    _check_no_corruption(dep, reference, 302)


def test_abort_while_the_write_is_in_flight(dep, reference):
    prompt = prompts(1, seed=311, lo=90, hi=90)[0]
    p_leg, d_leg = legs(dep, prompt, "tid-abort-mid-write", stream=True)
    # P counts a WRITE when its (injected) slow completion shows up; let earlier ones finish.
    wait_for(lambda: table(dep.p, "p_inflight") == 0, 10, "earlier WRITEs to finish")
    writes = metric(dep.p, "pdserve:kv_push_writes_total")

    async def run() -> None:
        assert (await post(dep.p.url, p_leg, "abort-mid-write")).status_code == 200
        task = asyncio.create_task(_stream(dep.d.url, d_leg, "abort-mid-write"))
        await asyncio.to_thread(wait_for, lambda: table(dep.p, "p_inflight") == 1, 20,
                                "P to post the WRITE")
        task.cancel()
        await asyncio.to_thread(wait_for, lambda: _quarantined(dep.d), 5, "the quarantine")
        assert table(dep.p, "p_inflight") == 1  # held while P may still be writing
        # Freed by whichever proves the WRITE is over first: its (late) completion, or P's
        # ACK, which P sends only once its WRITE has finished.
        await asyncio.to_thread(wait_for, lambda: _freed(dep.d), 2 * TTL, "the blocks freed")
        await asyncio.to_thread(wait_for, lambda: table(dep.p, "p_inflight") == 0, 2 * TTL,
                                "P's WRITE to finish")

    asyncio.run(run())
    assert metric(dep.p, "pdserve:kv_push_writes_total") == writes + 1
    assert_no_leaks(dep.engines)
    _check_no_corruption(dep, reference, 312)


def test_clients_vanishing_at_random_moments_through_the_proxy(dep, reference):
    rng = random.Random(321)
    ps = prompts(12, seed=322, lo=40, hi=160)

    async def one(i: int, p: list[int]) -> None:
        body = {**plain(p, 24), "stream": True}
        task = asyncio.create_task(_stream(dep.proxy.url, body, f"vanish-{i}"))
        await asyncio.sleep(rng.uniform(0.0, 2.5))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def run() -> None:
        await asyncio.gather(*(one(i, p) for i, p in enumerate(ps)))

    asyncio.run(run())
    assert_no_leaks(dep.engines, timeout=3 * TTL)
    _check_no_corruption(dep, reference, 323)
