"""NixlPushConnector: P writes its prefill KV straight into D's preallocated blocks.

The scheduler half is `PushScheduler`; the worker half below owns the NIXL transport, the
side channel that serves this engine's agent metadata, and the writer thread. Its one
`KVSecurity` (built once here, so the no-secret warning is logged once per engine) guards
both directions of the side channel (docs/security.md).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
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
from kvconnector.params import validate_kv_transfer_params
from kvconnector.push.meta import PushMeta
from kvconnector.push.peers import Peers
from kvconnector.push.receiver import Receiver
from kvconnector.push.scheduler import PushScheduler
from kvconnector.push.sender import Sender, SenderStats
from kvconnector.push.writer import PushWriter
from kvconnector.security import KVSecurity

logger = logging.getLogger(__name__)

__all__ = ["PushScheduler", "PushWorker", "validate_request_params"]


def validate_request_params(params: dict[str, Any]) -> None:
    validate_kv_transfer_params(params, "push")

TRANSFER_MODE = "push"
_HANDSHAKE_TIMEOUT_S = 3.0


class PushWorker(KVConnectorWorker):
    def __init__(self, config: EngineConfig, spec: KVCacheSpec) -> None:
        kv = config.kv_transfer_config
        assert kv is not None
        self.spec = spec
        self.engine_id = kv.engine_id or uuid.uuid4().hex[:12]
        self.host, self.port = kv.kv_host, kv.kv_port
        self.lease = float(kv.extra("kv_lease_duration", 30.0))
        self.ttl = float(kv.extra("push_registration_timeout", 480.0))
        self.hb_interval = float(kv.extra("heartbeat_interval", self.lease / 6))
        self.backends = list(kv.extra("backends", ["UCX"]))
        self.fault_injection = kv.extra("fault_injection", None)
        self.security = KVSecurity.from_config(kv)
        self.refused_handshakes = RefusedHandshakes()
        self.compat = compat_hash(spec.model_name, spec.dtype, spec.num_layers,
                                  spec.num_kv_heads, spec.head_dim, spec.block_size,
                                  TRANSFER_MODE)
        self.transport: NixlTransport | None = None
        self.writer: PushWriter | None = None
        self.side_channel: SideChannelServer | None = None

    def register_kv_caches(self, kv_cache: Any) -> None:
        self.transport = NixlTransport(
            f"{self.engine_id}-tp0", kv_cache, self.spec.bytes_per_block,
            backends=self.backends, fault_injection=self.fault_injection,
            engine_id=self.engine_id, block_size=self.spec.block_size,
            compat_hash=self.compat,
        )
        meta = self.transport.local_metadata()
        self.side_channel = SideChannelServer(self.host, self.port, lambda: meta, self.security)
        self.side_channel.start()
        wake = threading.Event()
        clock = time.monotonic
        t = self.transport
        peers = Peers(self._fetch, t.add_peer, wake, clock, remove_peer=t.remove_peer,
                      idle_after=max(self.lease, 2 * self.hb_interval))
        stats = SenderStats()
        sender = Sender(t, peers, clock, lease=self.lease, ttl=self.ttl, tp_size=1,
                        bytes_per_block=self.spec.bytes_per_block, stats=stats,
                        num_blocks=t.num_blocks)
        identity = {"decode_engine_id": self.engine_id, "decode_host": self.host,
                    "decode_port": self.side_channel.port, "decode_tp_size": 1}
        receiver = Receiver(t, peers, clock, identity=identity, ttl=self.ttl,
                            hb_interval=self.hb_interval, grace=self.lease / 6,
                            stats={"kv_push_registrations_sent_total": 0,
                                   "kv_recv_failed_total": 0, "kv_peer_gone_total": 0})
        self.writer = PushWriter(t, peers, sender, receiver, wake, clock)
        self.writer.start()
        logger.info("push connector %s ready: side channel %s:%d", self.engine_id, self.host,
                    self.side_channel.port)

    def _fetch(self, host: str, port: int) -> Any:
        with self.refused_handshakes:
            return fetch_peer_metadata(host, port, self.compat, _HANDSHAKE_TIMEOUT_S,
                                       security=self.security)

    def start_load_kv(self, metadata: PushMeta | None) -> None:
        if self.writer is not None and metadata is not None and metadata.brings_work():
            self.writer.inbox.put(metadata)
            self.writer.wake.set()

    def get_finished(self) -> KVConnectorOutput:
        if self.writer is None:
            return KVConnectorOutput()
        self.writer.wake.set()
        return self.writer.collect()

    def get_stats(self) -> dict[str, float]:
        if self.writer is None:
            return {}
        stats = dict(self.writer.sender.stats.counters)
        stats.update(self.writer.receiver.stats)
        stats["kv_malformed_notifs_total"] = self.writer.malformed
        stats["kv_refused_notifs_total"] = self.writer.sender.refused + self.writer.receiver.refused
        stats["kv_handshake_refused_total"] = self.refused_handshakes.count
        if self.transport is not None:
            stats["kv_refused_peers_total"] = self.transport.refused_peers
        if self.side_channel is not None:
            stats["kv_malformed_side_channel_total"] = self.side_channel.malformed_count
            stats["kv_side_channel_refused_total"] = self.side_channel.refused_count
        return stats

    def table_sizes(self) -> dict[str, int]:
        if self.writer is None:
            return {}
        return {**self.writer.sender.table_sizes(), **self.writer.receiver.table_sizes(),
                **self.writer.peers.table_sizes(), "nixl_agents": len(self.transport.peers())}

    def shutdown(self) -> None:
        if self.writer is not None:
            self.writer.stop()
            self.writer.peers.shutdown()
        if self.side_channel is not None:
            self.side_channel.stop()
        if self.transport is not None:
            self.transport.shutdown()
