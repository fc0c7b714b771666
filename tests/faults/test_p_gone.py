"""P's whole process dies (SIGKILL) with long prompts in flight, at the default lease and
registration timeout: every request through the proxy is still answered (D recomputes), and
D has every block back within two heartbeat intervals — its probe finds P's side channel
refusing connections, which proves no WRITE can land any more — instead of quarantining
them for 2 x push_registration_timeout (16 minutes at the defaults)."""

from __future__ import annotations

import asyncio
import signal
import time

import psutil
from fault_kit import (
    assert_d_recovered_from_p_death,
    cluster,
    plain,
    processes,
    prompts,
    stream_sse,
    table,
    wait_for,
)

NUM_BLOCKS = 512


def test_d_frees_every_block_soon_after_p_is_killed_mid_transfer(tiny_model, reference):
    # P holds every completion back, so all six stay "mid-transfer" on D when P dies.
    with cluster(tiny_model, num_blocks=NUM_BLOCKS, name="p-gone",
                 p_extra={"fault_injection": {"delay_notif": {"COMPLETION": 60.0}}},
                 proxy_args=("--request-timeout", "120")) as dep:
        d = dep.d
        ps = prompts(6, seed=501, lo=300, hi=400)

        async def run() -> tuple[list, float]:
            tasks = [asyncio.create_task(stream_sse(dep.proxy.url, plain(p), f"gone-{i}",
                                                    timeout=120)) for i, p in enumerate(ps)]
            await asyncio.to_thread(wait_for, lambda: table(d, "d_waiting") == len(ps), 60,
                                    "D to wait for P's KV for every request")
            procs = processes(dep.p)
            for proc in procs:
                proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            psutil.wait_procs(procs, timeout=10)
            return await asyncio.gather(*tasks), killed

        results, killed = asyncio.run(run())
        assert_d_recovered_from_p_death(d, results, reference(ps), NUM_BLOCKS, killed,
                                        within_s=10.0, peers_gone=1)
