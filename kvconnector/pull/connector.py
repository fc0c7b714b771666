"""NixlConnector (pull mode): D READs P's prefill KV from the blocks P leases to it.

Assembly only: the scheduler half is `PullScheduler`; the worker half is the shared
`NixlWorker` shell with pull mode's halves (`Lender` for P, `Reader` for D) on the
`nixl-pull-transfer` thread. The worker binds the side channel at its `Endpoint`; the
scheduler half advertises what it bound (`bind_workers`) in P's kv_transfer_params.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from engine.config import EngineConfig
from engine.connector_api import KVCacheSpec
from kvconnector import transfer_hist
from kvconnector.endpoint import Endpoint
from kvconnector.nixl import NixlTransport
from kvconnector.peers import Peers
from kvconnector.pull.lender import Lender
from kvconnector.pull.params import request_params_validator
from kvconnector.pull.reader import Reader
from kvconnector.pull.scheduler import PullScheduler
from kvconnector.pull.thread import PullThread
from kvconnector.worker import NixlWorker

__all__ = ["PullWorker", "make_scheduler", "make_worker", "request_params_validator"]


def _new_stats() -> dict[str, float]:
    return {"kv_pull_reads_total": 0, "kv_transfer_bytes_total": 0, **transfer_hist.initial(),
            "kv_pull_leases_total": 0,
            "kv_pull_leases_returned_total": 0, "kv_lease_expired_total": 0}


class PullWorker(NixlWorker):
    mode = "pull"

    def make_thread(self, transport: NixlTransport, peers: Peers, wake: threading.Event,
                    clock: Callable[[], float]) -> PullThread:
        stats = _new_stats()
        lender = Lender(clock, lease=self.lease, stats=stats)
        reader = Reader(transport, peers, clock, hb_interval=self.hb_interval,
                        bytes_per_block=self.spec.bytes_per_block, stats=stats,
                        stall_warning_s=self.lease)
        return PullThread(transport, peers, lender, reader, wake, clock)


def make_scheduler(config: EngineConfig, spec: KVCacheSpec) -> PullScheduler:
    """The scheduler half; it advertises what the worker half bound (`bind_workers`)."""
    return PullScheduler(config, spec)


def make_worker(config: EngineConfig, spec: KVCacheSpec, tp_rank: int) -> PullWorker:
    """The worker half (pull runs at tensor_parallel_size 1: rank 0)."""
    return PullWorker(config, spec, Endpoint.from_config(config.kv_transfer_config), tp_rank)
