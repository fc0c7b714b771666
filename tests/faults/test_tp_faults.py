"""Faults in P/D push at TP=2 on both sides (docs/design.md §8), each rank its own agent.

- P's rank-1 worker is SIGKILLed while every request waits for its KV on D (P holds its
  completions back). P's engine fails as a whole (§8 Failure: its EngineCore reports it dead
  and takes rank 0 down), so each of D's ranks finds its P rank's side channel gone: every
  request through the proxy is still answered (D recomputes), token for token as colocated,
  and D has every block back on every rank.
- The same kill with P at TP=2 and D at TP=1 (docs/design.md §8, heterogeneous sizes): D's
  one rank waits on two parts per request, one per P rank; both P side channels go, every
  request is still answered token for token and D has every block back.
- Seeded random WRITE failures on P's ranks: a request one rank of which got PUSH_FAIL while
  the other's KV landed is recomputed (a failure on any rank wins), answers stay right, and
  both engines end with every block back and every table empty.
- One P rank refuses (its WRITEs fail: PUSH_FAIL) while the other writes: D recomputes at
  once, long before its watchdog, and counts one failed receipt.
- One D rank's registration never reaches its P rank (a P rank that never answers): D's
  watchdog gives up on that rank alone and recomputes; the P rank that never got a
  registration frees its blocks when its lease runs out (D's heartbeats end with the cancel),
  and D's rank frees its blocks at its quarantine deadline (that P rank never met it, so
  cannot acknowledge the cancel).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import psutil
import pytest
from fault_kit import (
    assert_d_recovered_from_p_death,
    both_legs,
    cluster,
    kv_stat,
    legs,
    metric,
    plain,
    post_sync,
    prompts,
    stream_sse,
    table,
    text_of,
    wait_for,
)
from pd_harness import assert_no_leaks, engine_core, engine_stats
from server_streams import Stream

TP2 = ("--tensor-parallel-size", "2")
NUM_BLOCKS = 256
LONG_TOKENS = 300  # D still decodes when it is held


def _kill_p_rank1_mid_transfer(tiny_model: str, reference, name: str,
                               d_args: tuple[str, ...], parts: int) -> None:
    """P at TP=2 holds its completions back; once D waits on `parts` parts (summed over D's
    ranks) for every request, SIGKILL P's rank-1 worker. Every request must still be
    answered right, and D must have every block back."""
    with cluster(tiny_model, num_blocks=NUM_BLOCKS, name=name,
                 p_extra={"fault_injection": {"delay_notif": {"COMPLETION": 60.0}}},
                 p_args=TP2, d_args=[d_args],
                 # --retries 0: D's own recovery from P's death is what this test follows
                 proxy_args=("--request-timeout", "120", "--retries", "0")) as dep:
        d = dep.d
        ps = prompts(4, seed=601, lo=100, hi=200)
        rank1 = psutil.Process(engine_stats(dep.p)["tp_worker_pids"][1])

        async def run() -> tuple[list, float]:
            tasks = [asyncio.create_task(stream_sse(dep.proxy.url, plain(p), f"tp-{i}",
                                                    timeout=120)) for i, p in enumerate(ps)]
            # tables are summed over D's ranks
            await asyncio.to_thread(wait_for, lambda: table(d, "d_waiting") == parts * len(ps),
                                    60, "D to wait for every P rank's KV for every request")
            rank1.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            return await asyncio.gather(*tasks), killed

        results, killed = asyncio.run(run())
        # both P ranks' side channels go (P's engine fails as a whole)
        assert_d_recovered_from_p_death(d, results, reference(ps), NUM_BLOCKS, killed,
                                        within_s=15.0, peers_gone=2)
        # request counters count once per request, however many D ranks or parts failed
        # (docs/design.md §8)
        counters = engine_stats(d)["kv_connector"]
        assert counters["kv_recv_failed_total"] == len(ps)
        assert counters["kv_recompute_fallback_total"] == len(ps)


def test_killing_p_rank1_mid_transfer_answers_every_request_and_leaks_nothing(tiny_model,
                                                                               reference):
    _kill_p_rank1_mid_transfer(tiny_model, reference, "tp-rank-death", TP2, parts=2)


def test_killing_p_rank1_of_a_tp2_prefill_feeding_a_tp1_decode_leaks_nothing(tiny_model,
                                                                            reference):
    _kill_p_rank1_mid_transfer(tiny_model, reference, "tp-hetero-rank-death", (), parts=2)


def test_random_write_failures_on_single_ranks_recompute_and_leak_nothing(tiny_model,
                                                                          reference):
    faults = {"fail_write": True, "probability": 0.3, "seed": 5}
    with cluster(tiny_model, num_blocks=NUM_BLOCKS, name="tp-write-faults",
                 p_extra={"fault_injection": faults}, p_args=TP2, d_args=[TP2]) as dep:
        ps = prompts(12, seed=602, lo=20, hi=120)

        async def run() -> list:
            return await asyncio.gather(*(stream_sse(dep.proxy.url, plain(p), f"wf-{i}")
                                          for i, p in enumerate(ps)))

        results = asyncio.run(run())
        assert [error for _, error in results] == [None] * len(ps)
        assert [text for text, _ in results] == reference(ps)
        # each rank draws its own faults (seed + rank): some requests lost their KV on one or
        # both ranks and were recomputed (counted once per request), the others moved
        recomputed = engine_stats(dep.d)["kv_connector"]["kv_recompute_fallback_total"]
        assert 0 < recomputed < len(ps)
        assert engine_stats(dep.p)["kv_connector"]["kv_push_writes_total"] > 0
        assert_no_leaks([dep.p, dep.d])


TTL, LEASE = 4.0, 2.0  # the healthy rank must land within TTL on a loaded machine too
RANK1_FAILS_WRITES = {"fault_injection": {"by_rank": {"1": {"fail_write": True}}}}
RANK1_LOSES_REGS = {"fault_injection": {"by_rank": {"1": {"drop_notif": ["PUSH_REG"]}}}}


@pytest.fixture(scope="module")
def one_rank_faults(tiny_model: str):
    """P's rank 1 cannot WRITE; D0 is healthy; D1's rank 1 loses every PUSH_REG it sends."""
    with cluster(tiny_model, num_blocks=NUM_BLOCKS, name="tp-one-rank",
                 extra={"kv_lease_duration": LEASE, "push_registration_timeout": TTL},
                 p_extra=RANK1_FAILS_WRITES, d_extras=[{}, RANK1_LOSES_REGS],
                 p_args=TP2, d_args=[TP2, TP2], with_proxy=False) as dep:
        yield dep


def _counts(server, *names: str) -> dict[str, float]:
    return {n: metric(server, f"pdserve:{n}") for n in names}


def _grew(before: dict[str, float], server) -> dict[str, float]:
    return {n: metric(server, f"pdserve:{n}") - v for n, v in before.items()}


def test_push_fail_from_one_p_rank_recomputes_at_once(one_rank_faults, reference):
    dep, d = one_rank_faults, one_rank_faults.decodes[0]
    prompt = prompts(1, seed=603, lo=60, hi=60)[0]
    p_before = _counts(dep.p, "kv_push_writes_total", "kv_push_write_failures_total")
    d_before = _counts(d, "kv_recv_failed_total", "kv_recompute_fallback_total",
                       "kv_registration_expired_total")
    fail_sent = kv_stat(dep.p, "kv_push_fail_sent_total")
    out, latency = both_legs(dep, d, prompt, "tid-rank1-fails")
    assert text_of(out) == reference([prompt])[0]
    assert latency < TTL * 0.9, f"took {latency:.1f}s: rank 1's PUSH_FAIL did not end the wait"
    # rank 1 refused: one failed receipt on D, one recompute. D releases the transfer at
    # once (its blocks are recomputed elsewhere), so rank 0 wrote its heads only if its
    # WRITE went out before D's cancel reached it (a race either way)
    grew = _grew(p_before, dep.p)
    assert grew["kv_push_write_failures_total"] == 1 and grew["kv_push_writes_total"] in (0, 1)
    assert kv_stat(dep.p, "kv_push_fail_sent_total") == fail_sent + 1
    assert _grew(d_before, d) == {"kv_recv_failed_total": 1, "kv_recompute_fallback_total": 1,
                                  "kv_registration_expired_total": 0}
    assert_no_leaks([dep.p, d])


def test_watchdog_gives_up_on_the_one_p_rank_that_never_answers(one_rank_faults, reference):
    dep, d = one_rank_faults, one_rank_faults.decodes[1]
    prompt = prompts(1, seed=604, lo=60, hi=60)[0]
    p_before = _counts(dep.p, "kv_push_registrations_received_total",
                       "kv_push_writes_total", "kv_lease_expired_total")
    d_before = _counts(d, "kv_registration_expired_total", "kv_recompute_fallback_total")
    out, latency = both_legs(dep, d, prompt, "tid-rank1-silent")
    assert text_of(out) == reference([prompt])[0]
    assert latency >= TTL * 0.9, f"took {latency:.1f}s: the watchdog did not end the wait"
    assert _grew(d_before, d) == {"kv_registration_expired_total": 1,
                                  "kv_recompute_fallback_total": 1}
    # rank 1's blocks on P: no registration came; D1's watchdog cancel frees them (a cancel
    # frees blocks staged for a transfer no D rank matched), or its lease if it ends first
    assert_no_leaks([dep.p], timeout=2 * LEASE)
    grew = _grew(p_before, dep.p)
    assert grew["kv_push_registrations_received_total"] == grew["kv_push_writes_total"] == 1
    # D1's rank 1 quarantines until its deadline (2 x ttl after its PUSH_REG)
    assert_no_leaks([dep.p, d], timeout=4 * TTL)


LATE_S = 1.5  # P rank 0 posts its WRITE this long after matching it
LATE_WRITE = {"fault_injection": {"by_rank": {
    "0": {"delay_write_s": LATE_S},
    # rank 1 refuses; its PUSH_FAIL waits until rank 0 has surely matched and submitted
    "1": {"fail_write": True, "delay_notif": {"PUSH_FAIL": 0.5}}}}}


def test_a_late_write_from_one_rank_never_lands_in_the_blocks_d_recomputes_in(tiny_model,
                                                                              reference):
    """P's rank 1 refuses its WRITE (PUSH_FAIL) while rank 0's WRITE lands late, as over a
    slow network: D recomputes at once, in fresh blocks. The blocks the request registered
    stay held until rank 0's WRITE is over (it lands in them, not in the request's KV) and
    are freed after. Recomputing in the registered blocks let the late WRITE overwrite the
    KV D had decoded into the prompt's last, partial block: the answer left colocated's.

    No bet on the CPU's speed: D's engine core (its scheduler; the TP workers, whose agents
    the WRITE needs, run on) is held with SIGSTOP from D's third token until P counts the
    late WRITE done, so it lands while the request still decodes."""
    with cluster(tiny_model, num_blocks=NUM_BLOCKS, name="tp-late-write",
                 p_extra=LATE_WRITE, p_args=TP2, d_args=[TP2], with_proxy=False) as dep:
        d = dep.d
        # 4 blocks, the last one partial; no near-tie on its greedy path (top-2 logprob gap
        # >= 0.008 over the 300 tokens; TP=2 moves logprobs by ~1e-5)
        prompt = prompts(1, seed=617, lo=54, hi=54)[0]
        want = reference([prompt], LONG_TOKENS)[0]
        writes = metric(dep.p, "pdserve:kv_push_writes_total")
        recomputed = metric(d, "pdserve:kv_recompute_fallback_total")
        p_leg, d_leg = legs(dep, prompt, "tid-late-write", max_tokens=LONG_TOKENS)
        stream = Stream(d.url, LONG_TOKENS, body=d_leg, headers={"X-Request-Id": "tid-late-write"})
        stream.start()
        assert post_sync(dep.p.url, p_leg, "tid-late-write").status_code == 200
        wait_for(lambda: len(stream.events) >= 3 or stream.ended_at, 60, "D's third token")
        assert stream.ended_at is None, "D ended before it was held"
        core = engine_core(d.pid)
        core.suspend()
        try:
            wait_for(lambda: metric(dep.p, "pdserve:kv_push_writes_total") > writes,
                     LATE_S + 20, "P rank 0's late WRITE")
        finally:
            core.resume()
        stream.join(60)
        assert stream.error is None and stream.events[-1] == "[DONE]"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in stream.events[:-1]) == want
        assert metric(d, "pdserve:kv_recompute_fallback_total") == recomputed + 1
        assert_no_leaks([dep.p, d])
