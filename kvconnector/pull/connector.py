"""NixlConnector (pull mode): D READs P's prefill KV from the blocks P leases to it.

The scheduler half is `PullScheduler`; the worker half below owns the NIXL transport, the
side channel that serves this engine's agent metadata (bound at kv_host:kv_port, the
address P advertises in its kv_transfer_params), and the `nixl-pull-reader` thread.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from engine.config import EngineConfig
from engine.kv_connector import KVCacheSpec, KVConnectorOutput, KVConnectorWorker
from kvconnector.handshake import (
    RefusedHandshakes,
    SideChannelServer,
    compat_hash,
    fetch_peer_metadata,
)
from kvconnector.nixl import NixlTransport
from kvconnector.pull.endpoint import endpoint_for, forget
from kvconnector.pull.lender import Lender
from kvconnector.pull.meta import PullMeta
from kvconnector.pull.params import request_params_validator, validate_request_params
from kvconnector.pull.reader import Reader
from kvconnector.pull.scheduler import PullScheduler
from kvconnector.pull.thread import PullThread
from kvconnector.push.peers import Peers
from kvconnector.security import KVSecurity

logger = logging.getLogger(__name__)

__all__ = ["PullScheduler", "PullWorker", "request_params_validator", "validate_request_params"]

TRANSFER_MODE = "pull"
_HANDSHAKE_TIMEOUT_S = 3.0


def _new_stats() -> dict[str, float]:
    return {"kv_pull_reads_total": 0, "kv_transfer_bytes_total": 0,
            "kv_transfer_seconds_sum": 0.0, "kv_transfer_seconds_count": 0,
            "kv_recv_failed_total": 0, "kv_pull_leases_total": 0,
            "kv_pull_leases_returned_total": 0, "kv_lease_expired_total": 0}


class PullWorker(KVConnectorWorker):
    def __init__(self, config: EngineConfig, spec: KVCacheSpec) -> None:
        kv = config.kv_transfer_config
        assert kv is not None
        self.config = config
        self.spec = spec
        self.endpoint = endpoint_for(config)
        self.lease = float(kv.extra("kv_lease_duration", 30.0))
        self.hb_interval = float(kv.extra("heartbeat_interval", self.lease / 6))
        self.backends = list(kv.extra("backends", ["UCX"]))
        self.fault_injection = kv.extra("fault_injection", None)
        self.security = KVSecurity.from_config(kv)  # once per engine: one no-secret warning
        self.refused_handshakes = RefusedHandshakes()
        self.compat = compat_hash(spec.model_name, spec.dtype, spec.num_layers,
                                  spec.num_kv_heads, spec.head_dim, spec.block_size,
                                  TRANSFER_MODE)
        self.stats = _new_stats()
        self.transport: NixlTransport | None = None
        self.thread: PullThread | None = None
        self.side_channel: SideChannelServer | None = None

    def register_kv_caches(self, kv_cache: Any) -> None:
        ep = self.endpoint
        self.transport = t = NixlTransport(
            f"{ep.engine_id}-tp0", kv_cache, self.spec.bytes_per_block,
            backends=self.backends, fault_injection=self.fault_injection,
            engine_id=ep.engine_id, block_size=self.spec.block_size, compat_hash=self.compat,
        )
        meta = t.local_metadata()
        self.side_channel = SideChannelServer(ep.host, ep.port, lambda: meta, self.security)
        self.side_channel.start()
        ep.port = self.side_channel.port
        wake = threading.Event()
        clock = time.monotonic
        peers = Peers(self._fetch, t.add_peer, wake, clock)
        lender = Lender(clock, lease=self.lease, stats=self.stats)
        reader = Reader(t, peers, clock, hb_interval=self.hb_interval,
                        bytes_per_block=self.spec.bytes_per_block, stats=self.stats,
                        stall_warning_s=self.lease)
        self.thread = PullThread(t, peers, lender, reader, wake, clock)
        self.thread.start()
        logger.info("pull connector %s ready: side channel %s:%d", ep.engine_id, ep.host,
                    ep.port)

    def _fetch(self, host: str, port: int) -> Any:
        with self.refused_handshakes:
            return fetch_peer_metadata(host, port, self.compat, _HANDSHAKE_TIMEOUT_S,
                                       security=self.security)

    def start_load_kv(self, metadata: PullMeta | None) -> None:
        if self.thread is not None and metadata is not None and metadata.brings_work():
            self.thread.inbox.put(metadata)
            self.thread.wake.set()

    def get_finished(self) -> KVConnectorOutput:
        if self.thread is None:
            return KVConnectorOutput()
        self.thread.wake.set()
        return self.thread.collect()

    def get_stats(self) -> dict[str, float]:
        if self.thread is None:
            return {}
        stats = dict(self.stats)
        stats["kv_malformed_notifs_total"] = self.thread.malformed
        stats["kv_handshake_refused_total"] = self.refused_handshakes.count
        if self.transport is not None:
            stats["kv_refused_peers_total"] = self.transport.refused_peers
        if self.side_channel is not None:
            stats["kv_malformed_side_channel_total"] = self.side_channel.malformed_count
            stats["kv_side_channel_refused_total"] = self.side_channel.refused_count
        return stats

    def table_sizes(self) -> dict[str, int]:
        if self.thread is None:
            return {}
        return {**self.thread.lender.table_sizes(), **self.thread.reader.table_sizes()}

    def shutdown(self) -> None:
        if self.thread is not None:
            self.thread.stop()
            self.thread.peers.shutdown()
        if self.side_channel is not None:
            self.side_channel.stop()
        if self.transport is not None:
            self.transport.shutdown()
        forget(self.config)
