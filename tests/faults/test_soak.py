"""Soak: 500 requests at concurrency 32 through the proxy while P and both D's inject seeded
random faults into a few percent of their transport operations (lost and late notifications,
failed WRITE submissions, slow WRITEs, a failed handshake). Every request ends in bounded
time, every answer is the reference's or a clear error, and nothing leaks.

Runs after every other test of the session (see conftest.py): it is the longest one.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from fault_kit import cluster, metric, plain, post, prompts, stream_sse
from pd_harness import assert_no_leaks

N, CONCURRENCY, MAX_TOKENS = 500, 32, 6
LEASE, TTL = 2.0, 3.0
BOUND = 30.0  # per request: watchdog + recompute under load, with room to spare
P_FAULTS = {"drop_notif": ["COMPLETION", "PUSH_FAIL", "PUSH_CANCEL_ACK"],
            "delay_notif": {"COMPLETION": 0.3}, "fail_write": True,
            "delay_write_completion_s": 0.2, "probability": 0.05, "seed": 11}
D_FAULTS = {"drop_notif": ["PUSH_REG", "HB", "PUSH_CANCEL"], "delay_notif": {"PUSH_REG": 0.3},
            "fail_handshake": True, "probability": 0.05}


@pytest.fixture(scope="module")
def dep(tiny_model: str):
    with cluster(tiny_model, num_blocks=512, name="soak",
                 extra={"kv_lease_duration": LEASE, "push_registration_timeout": TTL},
                 p_extra={"fault_injection": P_FAULTS},
                 d_extras=[{"fault_injection": {**D_FAULTS, "seed": 12}},
                           {"fault_injection": {**D_FAULTS, "seed": 13}}],
                 proxy_args=("--request-timeout", str(BOUND))) as d:
        yield d


@pytest.mark.slow
def test_soak_with_random_faults_ends_every_request_correctly_and_leaks_nothing(
        dep, reference):
    ps = prompts(N, seed=601, lo=8, hi=64)
    expected = reference(ps, MAX_TOKENS)

    async def one(i: int, sem: asyncio.Semaphore) -> tuple[str, str | None, float]:
        async with sem:
            started = time.monotonic()
            if i % 2:
                text, error = await stream_sse(dep.proxy.url, plain(ps[i], MAX_TOKENS),
                                               f"soak-{i}", timeout=BOUND + 10)
            else:
                r = await post(dep.proxy.url, plain(ps[i], MAX_TOKENS), f"soak-{i}",
                               timeout=BOUND + 10)
                ok = r.status_code == 200
                text = r.json()["choices"][0]["text"] if ok else ""
                error = None if ok else r.json()["error"]["message"]
            return text, error, time.monotonic() - started

    async def run() -> list[tuple[str, str | None, float]]:
        sem = asyncio.Semaphore(CONCURRENCY)
        return await asyncio.gather(*(one(i, sem) for i in range(N)))

    started = time.monotonic()
    results = asyncio.run(run())
    took = time.monotonic() - started
    wrong = [(i, text, want) for i, ((text, error, _), want)
             in enumerate(zip(results, expected, strict=True)) if error is None and text != want]
    errors = [(i, error) for i, (_, error, _) in enumerate(results) if error is not None]
    slowest = max(latency for _, _, latency in results)
    assert not wrong, f"{len(wrong)} wrong answers, e.g. {wrong[:3]}"
    assert all(error and len(error) > 10 for _, error in errors), errors[:5]
    assert len(errors) <= N // 20, f"{len(errors)} errors, e.g. {errors[:5]}"
    assert slowest < BOUND, f"a request took {slowest:.1f}s"
    # The faults really happened, and the fallbacks really ran.
    assert metric(dep.p, "pdserve:kv_push_write_failures_total") >= 1
    assert sum(metric(d, "pdserve:kv_registration_expired_total") for d in dep.decodes) >= 1
    assert sum(metric(d, "pdserve:kv_recompute_fallback_total") for d in dep.decodes) >= 5
    assert sum(metric(d, "pdserve:kv_remote_prefill_tokens_total") for d in dep.decodes) > 0
    print(f"soak: {N} requests in {took:.0f}s, {len(errors)} errors, slowest {slowest:.1f}s")
    assert_no_leaks(dep.engines, timeout=LEASE + 3 * TTL + 10)
