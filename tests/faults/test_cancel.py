"""D gives up on a registered transfer (the client went away): its blocks stay quarantined
until P acknowledges the PUSH_CANCEL (or the WRITE's completion shows it landed), then are
freed; nothing P sends later lands in them.

Also at TP=2 on P and D (docs/design.md §8): every D rank registers with, cancels at and is
acknowledged by its own P rank; D's blocks are freed only once every rank is safe
(connector tables and counters are the ranks' sums).
"""

from __future__ import annotations

import asyncio
import random
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
    prompts,
    table,
    text_of,
    wait_for,
)
from pd_harness import assert_no_leaks, engine_stats

TTL = 6.0
LEASE = 4.0
ACK_DELAY = 1.5
ACKS = "kv_push_cancel_acks_received_total"
P_FAULTS = {"delay_notif": {"PUSH_CANCEL_ACK": ACK_DELAY, "COMPLETION": 1.0},
            "delay_write_completion_s": 2.5}


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def tp(request) -> int:
    return request.param


@pytest.fixture(scope="module")
def dep(tiny_model: str, tp: int):
    tp_args = ("--tensor-parallel-size", str(tp))
    with cluster(tiny_model, name=f"cancel-tp{tp}", p_args=tp_args, d_args=[tp_args],
                 extra={"kv_lease_duration": LEASE, "push_registration_timeout": TTL},
                 p_extra={"fault_injection": P_FAULTS}) as d:
        yield d


async def _stream(url: str, body: dict, rid: str) -> None:
    async with httpx.AsyncClient(timeout=60) as c, c.stream(
            "POST", f"{url}/v1/completions", json=body, headers={"X-Request-Id": rid}) as r:
        async for _ in r.aiter_raw():
            pass


def _quarantined(d, tp: int) -> bool:
    st = engine_stats(d)  # on every rank
    return st["d_quarantine"] == tp and st["num_free_blocks"] < st["num_kv_blocks"]


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


def test_abort_after_registration_quarantines_until_the_cancel_ack(dep, reference, tp):
    """At TP=2 every D rank's blocks wait for its own P rank's ACK."""
    _abort_after_registration(dep, reference, tp, "tid-abort-early")


@pytest.mark.parametrize("tp", [1], ids=["tp1"], indirect=True)  # no per-rank matter
def test_abort_without_transfer_id_cancels_and_acks_by_request_id(dep, reference, tp):
    """Without a transfer_id (vLLM's push protocol) cancel, ACK and P's refusal to write
    work by request id."""
    _abort_after_registration(dep, reference, tp, None)


def _abort_after_registration(dep, reference, tp: int, tid: str | None) -> None:
    prompt = prompts(1, seed=301 if tid else 303, lo=90, hi=90)[0]
    p_leg, d_leg = legs(dep, prompt, tid, stream=True)
    rid = "abort-early" if tid else "abort-early-no-id"
    # P counts a WRITE when its (injected) slow completion shows up; let earlier ones finish.
    wait_for(lambda: table(dep.p, "p_inflight") == 0, 10, "earlier WRITEs to finish")
    received = metric(dep.p, "pdserve:kv_push_registrations_received_total")
    writes = metric(dep.p, "pdserve:kv_push_writes_total")
    acks = kv_stat(dep.d, ACKS)

    async def run() -> float:
        task = asyncio.create_task(_stream(dep.d.url, d_leg, rid))
        await asyncio.to_thread(
            wait_for, lambda: metric(dep.p, "pdserve:kv_push_registrations_received_total")
            >= received + tp, 20, "every P rank to receive its registration")
        task.cancel()  # the client disconnects before P has prefilled anything
        aborted = time.monotonic()
        await asyncio.to_thread(wait_for, lambda: _quarantined(dep.d, tp), 5, "the quarantine")
        await asyncio.to_thread(wait_for, lambda: _freed(dep.d), 2 * TTL, "the blocks freed")
        return time.monotonic() - aborted

    held = asyncio.run(run())
    assert ACK_DELAY * 0.8 <= held < 2 * TTL, f"blocks held {held:.1f}s"
    assert kv_stat(dep.d, ACKS) == acks + tp  # each P rank acknowledged its rank's cancel
    # P's leg still comes; P must not write into blocks D has freed, and frees them as soon
    # as its prefill is over (the transfer is tombstoned), not at lease expiry.
    expired = metric(dep.p, "pdserve:kv_lease_expired_total")
    assert asyncio.run(post(dep.p.url, p_leg, rid)).status_code == 200
    wait_for(lambda: _freed(dep.p) and table(dep.p, "p_staged") == 0, LEASE / 2,
             "P to free the blocks of a transfer D cancelled")
    assert metric(dep.p, "pdserve:kv_lease_expired_total") == expired
    assert metric(dep.p, "pdserve:kv_push_writes_total") == writes
    assert_no_leaks(dep.engines)
    _check_no_corruption(dep, reference, 302)


def test_abort_while_the_write_is_in_flight(dep, reference, tp):
    prompt = prompts(1, seed=311, lo=90, hi=90)[0]
    p_leg, d_leg = legs(dep, prompt, "tid-abort-mid-write", stream=True)
    # P counts a WRITE when its (injected) slow completion shows up; let earlier ones finish.
    wait_for(lambda: table(dep.p, "p_inflight") == 0, 10, "earlier WRITEs to finish")
    writes = metric(dep.p, "pdserve:kv_push_writes_total")

    async def run() -> None:
        assert (await post(dep.p.url, p_leg, "abort-mid-write")).status_code == 200
        task = asyncio.create_task(_stream(dep.d.url, d_leg, "abort-mid-write"))
        await asyncio.to_thread(wait_for, lambda: table(dep.p, "p_inflight") == tp, 20,
                                "every P rank to post its WRITE")
        task.cancel()
        await asyncio.to_thread(wait_for, lambda: _quarantined(dep.d, tp), 5, "the quarantine")
        assert table(dep.p, "p_inflight") == tp  # held while P may still be writing
        # Freed by whichever proves the WRITE is over first: its (late) completion, or P's
        # ACK, which P sends only once its WRITE has finished.
        await asyncio.to_thread(wait_for, lambda: _freed(dep.d), 2 * TTL, "the blocks freed")
        await asyncio.to_thread(wait_for, lambda: table(dep.p, "p_inflight") == 0, 2 * TTL,
                                "P's WRITE to finish")

    asyncio.run(run())
    assert metric(dep.p, "pdserve:kv_push_writes_total") == writes + tp
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
