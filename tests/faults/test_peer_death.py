"""An engine dies (SIGKILL) mid-flight: every request through the proxy still ends, quickly,
with the right tokens or a clear error; the survivors free everything and keep serving.

One deployment (P, D0, D1 behind the proxy), killed in stages: D0 first, then P's
EngineCore. The tests run in file order and each states what it starts from.
"""

from __future__ import annotations

import asyncio
import signal
import time

import psutil
import pytest
from fault_kit import (
    cluster,
    metric,
    plain,
    post,
    processes,
    prompts,
    stream_sse,
    table,
    text_of,
    wait_for,
)
from pd_harness import assert_no_leaks, engine_stats

LEASE, TTL = 2.0, 5.0
BOUND = 10.0  # every request ends within this after the kill


@pytest.fixture(scope="module")
def dep(tiny_model: str):
    # P holds each completion back a little, so requests spend time "mid-transfer" on D.
    with cluster(tiny_model, name="death", d_extras=[{}, {}],
                 extra={"kv_lease_duration": LEASE, "push_registration_timeout": TTL},
                 p_extra={"fault_injection": {"delay_notif": {"COMPLETION": 0.5}}},
                 # --retries 0: no retry or stream migration, so the failure path is what
                 # these tests follow (migration: tests/faults/test_stream_migration.py)
                 proxy_args=("--request-timeout", "60", "--retries", "0")) as d:
        yield d


async def _timed(coro) -> tuple[str, str | None, float]:
    text, error = await coro
    return text, error, time.monotonic()


def test_decode_killed_mid_decode_fails_its_requests_and_the_proxy_routes_around_it(
        dep, reference):
    d0, d1 = dep.decodes
    ps = prompts(8, seed=401, lo=60, hi=200)
    body = {"ignore_eos": True}

    async def run() -> tuple[list, float]:
        tasks = [asyncio.create_task(_timed(stream_sse(dep.proxy.url, {**plain(p, 200),
                                                                     **body}, f"dk-{i}")))
                 for i, p in enumerate(ps)]
        await asyncio.to_thread(wait_for, lambda: engine_stats(d0)["num_running_reqs"] >= 2,
                                30, "D0 to decode")
        procs = processes(d0)
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        psutil.wait_procs(procs, timeout=10)
        return await asyncio.gather(*tasks), killed

    results, killed = asyncio.run(run())
    expected = reference(ps, 200)
    ok = failed = 0
    for (text, error, ended), want in zip(results, expected, strict=True):
        assert ended - killed < BOUND
        if error is None:
            assert text == want
            ok += 1
        else:
            assert "decode" in error.lower() or "D0" in error or str(d0.port) in error, error
            failed += 1
    assert ok >= 1 and failed >= 1, (ok, failed)
    # The proxy notices and routes everything to D1.
    time.sleep(1.5)
    more = prompts(4, seed=402)
    outs = asyncio.run(_all(dep.proxy.url, more))
    assert outs == reference(more)
    # A prefill whose D died before registering: P frees its blocks when the lease ends.
    expired = metric(dep.p, "pdserve:kv_lease_expired_total")
    p_leg = {**plain(ps[0], 1), "kv_transfer_params": {"do_remote_decode": True,
                                                        "transfer_id": "tid-for-dead-d0"}}
    assert asyncio.run(post(dep.p.url, p_leg, "for-dead-d0")).status_code == 200
    wait_for(lambda: metric(dep.p, "pdserve:kv_lease_expired_total") > expired, 3 * LEASE,
             "P's lease to expire")
    assert_no_leaks([dep.p, d1], timeout=LEASE + 2 * TTL + 5)
    assert dep.decodes[0].process.poll() is not None


async def _all(url: str, ps: list[list[int]]) -> list[str]:
    outs = await asyncio.gather(*(post(url, plain(p), f"after-{i}-{p[0]}")
                                  for i, p in enumerate(ps)))
    return [text_of(o) for o in outs]


def test_prefill_core_killed_mid_prefill_and_mid_transfer(dep, reference):
    d1 = dep.decodes[1]
    assert dep.decodes[0].process.poll() is not None  # the previous test killed D0
    ps = prompts(10, seed=411, lo=100, hi=300)
    core = [p for p in processes(dep.p)[1:]]  # EngineCore and helpers; the API server lives

    async def run() -> tuple[list, float]:
        tasks = [asyncio.create_task(_timed(stream_sse(dep.proxy.url, plain(p), f"pk-{i}")))
                 for i, p in enumerate(ps)]
        await asyncio.to_thread(wait_for, lambda: table(d1, "d_waiting") >= 2, 30,
                                "D1 to wait for P's KV")
        for proc in core:
            proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        return await asyncio.gather(*tasks), killed

    results, killed = asyncio.run(run())
    expected = reference(ps)
    for (text, error, ended), want in zip(results, expected, strict=True):
        assert ended - killed < BOUND, f"ended {ended - killed:.1f}s after the kill"
        if error is None:
            assert text == want
        else:
            assert "prefill" in error.lower(), error
    assert sum(1 for r in results if r[1] is None) >= len(ps) // 2
    assert metric(d1, "pdserve:kv_recompute_fallback_total") >= 1
    # D keeps serving on its own, and so does the proxy without a prefill engine: D
    # computes the prompt (--p-failure-policy recompute), the client gets its answer.
    fresh = prompts(3, seed=412)
    outs = asyncio.run(_all(d1.url, fresh))
    assert outs == reference(fresh)
    started = time.monotonic()
    text, error = asyncio.run(stream_sse(dep.proxy.url, plain(fresh[0]), "no-prefill"))
    assert (text, error) == (reference(fresh[:1])[0], None)
    assert time.monotonic() - started < BOUND
    assert_no_leaks([d1], timeout=2 * TTL + 10)
