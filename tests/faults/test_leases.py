"""P's block leases: freed when D never registers, kept alive by D's heartbeats while D queues.

Also at TP=2 on both sides (docs/design.md §8): every P rank stages its share of the blocks
under its own lease, expires it on its own (the counter is the ranks' sum: one expiry per
rank), and each D rank heartbeats its P rank while the request queues.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from fault_kit import (
    cluster,
    legs,
    metric,
    post,
    post_sync,
    prompts,
    table,
    text_of,
)
from fault_kit import wait_for as wait
from pd_harness import assert_no_leaks, engine_stats

LEASE = 2.0
D_BLOCKS = 64
HOG_TOKENS = (D_BLOCKS - 4) * 16  # a prompt that leaves D 4 free blocks
EXPIRED = "pdserve:kv_lease_expired_total"


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def tp(request) -> int:
    """Tensor-parallel size of P and D (connector tables and counters sum over the ranks)."""
    return request.param


@pytest.fixture(scope="module")
def dep(tiny_model: str, tp: int):
    # D's cache is small (P's is not), so a D leg that waits for its KV can hold nearly all
    # of D's blocks and make the next D leg queue for as long as a test wants.
    tp_args = ("--tensor-parallel-size", str(tp))
    with cluster(tiny_model, num_blocks=D_BLOCKS, p_args=("--num-kv-blocks", "256", *tp_args),
                 d_args=[tp_args],
                 # the hog's P leg comes seconds after its D leg: not a stray registration
                 extra={"kv_lease_duration": LEASE, "push_registration_timeout": 20,
                        "push_unknown_transfer_timeout": 20},
                 with_proxy=False, name=f"leases-tp{tp}") as d:
        yield d


def test_blocks_of_a_transfer_d_never_claims_are_freed_at_lease_expiry(dep, tp):
    expired = metric(dep.p, EXPIRED)
    p_leg, _ = legs(dep, prompts(1, seed=1, lo=80, hi=80)[0], "tid-never-claimed")
    started = time.monotonic()
    assert post_sync(dep.p.url, p_leg, "never-claimed").status_code == 200
    st = engine_stats(dep.p)
    assert st["p_staged"] == tp  # every P rank holds the prompt's blocks for D ...
    assert st["num_free_blocks"] <= st["num_kv_blocks"] - 80 // 16
    wait(lambda: metric(dep.p, EXPIRED) >= expired + tp, 3 * LEASE,
         "every rank's lease to expire")
    assert time.monotonic() - started >= LEASE * 0.9  # ... until the lease, not before
    assert metric(dep.p, EXPIRED) == expired + tp  # once per rank
    assert table(dep.p, "p_staged") == 0
    assert_no_leaks(dep.engines)


def test_heartbeats_keep_blocks_while_d_queues_longer_than_the_lease(dep, reference, tp):
    """At TP=2 each D rank heartbeats its own P rank."""
    _heartbeats_keep_blocks(dep, reference, tp, "tid-queued")


@pytest.mark.parametrize("tp", [1], ids=["tp1"], indirect=True)  # no per-rank matter
def test_heartbeats_name_a_transfer_without_id_by_its_base_request_id(dep, reference, tp):
    """Without a transfer_id (vLLM's push protocol) D names the transfer by its base
    request id in the heartbeat."""
    _heartbeats_keep_blocks(dep, reference, tp, None)


def _heartbeats_keep_blocks(dep, reference, tp: int, tid: str | None) -> None:
    prompt = prompts(1, seed=2 if tid else 4, lo=90, hi=90)[0]
    rid = "queued" if tid else "queued-no-id"
    # The hog is a D leg whose KV arrives only when the test sends its P leg; meanwhile it
    # holds all but 4 of D's blocks, so the D leg under test (6 blocks) cannot be admitted
    # and queues until the test lets the hog finish: no bet on how fast the CPU decodes.
    hog = prompts(1, seed=3 if tid else 5, lo=HOG_TOKENS, hi=HOG_TOKENS)[0]
    p_leg, d_leg = legs(dep, prompt, tid)
    hog_p_leg, hog_d_leg = legs(dep, hog, f"tid-hog-{rid}")
    expired = metric(dep.p, EXPIRED)
    writes = metric(dep.p, "pdserve:kv_push_writes_total")
    remote = metric(dep.d, "pdserve:kv_remote_prefill_tokens_total")

    async def run() -> tuple[str, str, float]:
        hog_task = asyncio.create_task(post(dep.d.url, hog_d_leg, f"hog-{rid}"))
        await asyncio.to_thread(wait, lambda: table(dep.d, "d_waiting") == tp, 20,
                                "the hog to hold D's blocks (on every rank)")
        d_task = asyncio.create_task(post(dep.d.url, d_leg, rid))
        await asyncio.to_thread(wait, lambda: table(dep.d, "d_queued") == tp, 20,
                                "the D leg to queue behind the hog (on every rank)")
        assert (await post(dep.p.url, p_leg, rid)).status_code == 200
        p_done = time.monotonic()
        await asyncio.sleep(3 * LEASE)  # the time under test: three leases pass
        assert not d_task.done() and table(dep.d, "d_queued") == tp  # still queued
        assert (await post(dep.p.url, hog_p_leg, f"hog-{rid}")).status_code == 200  # let it go
        out, hog_out = await d_task, await hog_task
        return text_of(out), text_of(hog_out), time.monotonic() - p_done

    text, hog_text, waited = asyncio.run(run())
    assert waited > 3 * LEASE
    assert text == reference([prompt])[0]
    assert hog_text == reference([hog])[0]
    assert metric(dep.p, EXPIRED) == expired  # the heartbeats kept P's blocks ...
    # ... for the WRITEs (one per request and rank)
    assert metric(dep.p, "pdserve:kv_push_writes_total") == writes + 2 * tp
    assert (metric(dep.d, "pdserve:kv_remote_prefill_tokens_total") - remote
            == len(prompt) - 1 + len(hog) - 1)
    assert_no_leaks(dep.engines)
