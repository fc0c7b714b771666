"""P's block leases: freed when D never registers, kept alive by D's heartbeats while D queues."""

from __future__ import annotations

import asyncio
import time

import pytest
from fault_kit import (
    cluster,
    legs,
    metric,
    plain,
    post,
    post_sync,
    prompts,
    stream_sse,
    table,
    text_of,
)
from fault_kit import wait_for as wait
from pd_harness import assert_no_leaks, engine_stats

LEASE = 2.0
EXPIRED = "pdserve:kv_lease_expired_total"


@pytest.fixture(scope="module")
def dep(tiny_model: str):
    # D runs one sequence at a time, so a D leg can queue for longer than P's lease.
    with cluster(tiny_model, extra={"kv_lease_duration": LEASE, "push_registration_timeout": 20},
                 d_args=[("--max-num-seqs", "1")], with_proxy=False, name="leases") as d:
        yield d


def test_blocks_of_a_transfer_d_never_claims_are_freed_at_lease_expiry(dep):
    expired = metric(dep.p, EXPIRED)
    p_leg, _ = legs(dep, prompts(1, seed=1, lo=80, hi=80)[0], "tid-never-claimed")
    started = time.monotonic()
    assert post_sync(dep.p.url, p_leg, "never-claimed").status_code == 200
    st = engine_stats(dep.p)
    assert st["p_staged"] == 1  # P holds the prompt's blocks for D ...
    assert st["num_free_blocks"] <= st["num_kv_blocks"] - 80 // 16
    wait(lambda: metric(dep.p, EXPIRED) >= expired + 1, 3 * LEASE, "the lease to expire")
    assert time.monotonic() - started >= LEASE * 0.9  # ... until the lease, not before
    assert table(dep.p, "p_staged") == 0
    assert_no_leaks(dep.engines)


@pytest.mark.parametrize("tid", ["tid-queued", None], ids=["transfer_id", "no_id"])
def test_heartbeats_keep_blocks_while_d_queues_longer_than_the_lease(dep, reference, tid):
    """Without a transfer_id (vLLM's push protocol) D names the transfer by its base
    request id in the heartbeat."""
    prompt = prompts(1, seed=2 if tid else 4, lo=90, hi=90)[0]
    p_leg, d_leg = legs(dep, prompt, tid)
    rid = "queued" if tid else "queued-no-id"
    expired = metric(dep.p, EXPIRED)
    writes = metric(dep.p, "pdserve:kv_push_writes_total")
    remote = metric(dep.d, "pdserve:kv_remote_prefill_tokens_total")
    # Three long requests ahead of the D leg (one runs, two wait); the client drops them
    # once the D leg has queued for 3 leases, so the delay does not depend on CPU speed
    # (a fast machine may finish the first one within that time: the others still queue).
    blocker = {**plain(prompts(1, seed=3)[0], 900), "ignore_eos": True}

    async def run() -> tuple[str, float]:
        blockers = [asyncio.create_task(stream_sse(dep.d.url, blocker, f"blocker-{i}",
                                                   timeout=120)) for i in range(3)]
        await asyncio.to_thread(wait, lambda: engine_stats(dep.d)["num_unfinished_requests"]
                                == 3, 20, "the blockers to occupy D")
        d_task = asyncio.create_task(post(dep.d.url, d_leg, rid))  # queues behind
        assert (await post(dep.p.url, p_leg, rid)).status_code == 200
        p_done = time.monotonic()
        await asyncio.sleep(3 * LEASE)
        assert not d_task.done()  # still queued behind the blockers after 3 leases
        for b in blockers:
            b.cancel()
        out = await d_task
        return text_of(out), time.monotonic() - p_done

    text, waited = asyncio.run(run())
    assert waited > 3 * LEASE
    assert text == reference([prompt])[0]
    assert metric(dep.p, EXPIRED) == expired  # the heartbeats kept P's blocks ...
    assert metric(dep.p, "pdserve:kv_push_writes_total") == writes + 1  # ... for the WRITE
    assert metric(dep.d, "pdserve:kv_remote_prefill_tokens_total") - remote == len(prompt) - 1
    assert_no_leaks(dep.engines)
