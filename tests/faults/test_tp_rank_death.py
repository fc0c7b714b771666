"""P/D push at TP=2 on both sides: P's rank-1 worker is SIGKILLed while every request waits
for its KV on D (P holds its completions back). P's engine fails as a whole (docs/design.md
§8 Failure: its EngineCore reports it dead and takes rank 0 down), so each of D's ranks finds
its P rank's side channel gone: every request through the proxy is still answered (D
recomputes), token for token as colocated, and D has every block back on every rank."""

from __future__ import annotations

import asyncio
import signal
import time

import psutil
from fault_kit import cluster, plain, prompts, stream_sse, table, wait_for
from pd_harness import assert_no_leaks, engine_stats

TP2 = ("--tensor-parallel-size", "2")
HEARTBEAT_S = 30.0 / 6  # the default lease / 6
NUM_BLOCKS = 256


def test_killing_p_rank1_mid_transfer_answers_every_request_and_leaks_nothing(tiny_model,
                                                                               reference):
    with cluster(tiny_model, num_blocks=NUM_BLOCKS, name="tp-rank-death",
                 p_extra={"fault_injection": {"delay_notif": {"COMPLETION": 60.0}}},
                 p_args=TP2, d_args=[TP2], proxy_args=("--request-timeout", "120")) as dep:
        d = dep.d
        ps = prompts(4, seed=601, lo=100, hi=200)
        rank1 = psutil.Process(engine_stats(dep.p)["tp_worker_pids"][1])

        async def run() -> tuple[list, float]:
            tasks = [asyncio.create_task(stream_sse(dep.proxy.url, plain(p), f"tp-{i}",
                                                    timeout=120)) for i, p in enumerate(ps)]
            # every request waits on both of D's ranks (tables are summed over the ranks)
            await asyncio.to_thread(wait_for, lambda: table(d, "d_waiting") == 2 * len(ps),
                                    60, "both D ranks to wait for P's KV for every request")
            rank1.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            return await asyncio.gather(*tasks), killed

        results, killed = asyncio.run(run())
        assert [error for _, error in results] == [None] * len(ps)
        assert [text for text, _ in results] == reference(ps)
        wait_for(lambda: engine_stats(d)["num_free_blocks"] == NUM_BLOCKS
                 and table(d, "d_quarantine") == 0, 2 * HEARTBEAT_S,
                 "D to free every block on every rank")
        assert time.monotonic() - killed < 15.0
        assert_no_leaks([d], timeout=1)
        assert engine_stats(d)["kv_connector"]["kv_peer_gone_total"] >= 2  # one per rank
