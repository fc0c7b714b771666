"""The worker half both NIXL connectors share: transport, side channel, peers, transfer thread.

`NixlWorker` owns, per engine: one `NixlTransport` over the KV cache, the `SideChannelServer`
that serves this engine's agent metadata at the endpoint's host:port (guarded by one
`KVSecurity`, built here so the no-secret warning is logged once per engine; see
docs/security.md), the `Peers` table of remote engines, and one `TransferThread`. A mode
subclasses it with its policy only: `mode` (part of the compatibility hash, so a push engine
never pairs with a pull one), `prune_idle_peers`, and `make_thread`, which builds the mode's
halves and routes around the shared pieces.

Threads: every method here runs on the engine-core thread. The transfer thread owns the
halves, the peers table and the transport's notifications; it and this object meet only in
the thread's inbox and outbox.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from engine.config import EngineConfig
from engine.connector_api import KVCacheSpec, KVConnectorWorker
from engine.connector_seam import KVBinding, KVConnectorMetadata, KVConnectorOutput
from engine.models.formats import load_arch
from kvconnector.endpoint import Endpoint, side_channel_port
from kvconnector.handshake import (
    RefusedHandshakes,
    SideChannelServer,
    compat_hash,
    fetch_peer_metadata,
)
from kvconnector.nixl import NixlTransport
from kvconnector.peers import Peers
from kvconnector.security import KVSecurity
from kvconnector.tp_layout import rank_layout
from kvconnector.transfer_thread import TransferThread
from kvconnector.transport import make_transport

logger = logging.getLogger(__name__)

_HANDSHAKE_TIMEOUT_S = 3.0


class NixlWorker(KVConnectorWorker):
    mode = ""  # "push" | "pull"
    prune_idle_peers = False  # drop idle peers and their NIXL agents (see Peers.prune)

    meta_type: type[KVConnectorMetadata] | None = None  # the mode's per-step metadata

    def __init__(self, config: EngineConfig, spec: KVCacheSpec,
                 endpoint: Endpoint | None = None, tp_rank: int = 0) -> None:
        kv = config.kv_transfer_config
        assert kv is not None
        self.spec = spec
        self.endpoint = endpoint or Endpoint.from_config(kv)
        # Tensor parallel (docs/design.md §8): rank r of N owns agent <engine_id>-tp<r> and
        # serves its side channel at its rank's place in the port layout (kv_port: this DP
        # rank's own); its peers are the same rank of the other side.
        self.tp_rank = tp_rank
        self.tp_size = config.tensor_parallel_size
        self.endpoint.port = side_channel_port(self.endpoint.port, 0, tp_rank, self.tp_size)
        self.lease = float(kv.extra("kv_lease_duration", 30.0))
        self.ttl = float(kv.extra("push_registration_timeout", 480.0))
        self.hb_interval = float(kv.extra("heartbeat_interval", self.lease / 6))
        self.backends = list(kv.extra("backends", ["UCX"]))
        self.fault_injection = kv.extra("fault_injection", None)
        fi = self.fault_injection
        if tp_rank and isinstance(fi, dict) and fi.get("seed") is not None:
            self.fault_injection = {**fi, "seed": fi["seed"] + tp_rank}  # each rank its draws
        self.security = KVSecurity.from_config(kv)
        self.refused_handshakes = RefusedHandshakes()
        # where this rank's KV heads lie in a block; engines of other TP sizes pair with it
        # by the model's total KV heads (docs/design.md §8)
        self.layout = rank_layout(spec, load_arch(config.model).num_kv_heads, tp_rank,
                                  self.tp_size)
        self.compat = compat_hash(spec.model_name, spec.dtype, spec.num_layers,
                                  self.layout.total_heads, spec.head_dim, spec.block_size,
                                  self.mode)
        self.transport: NixlTransport | None = None
        self.side_channel: SideChannelServer | None = None
        self.thread: TransferThread | None = None

    def make_thread(self, transport: NixlTransport, peers: Peers, wake: threading.Event,
                    clock: Callable[[], float]) -> TransferThread:
        """The mode's halves and routes around the shared pieces (not started)."""
        raise NotImplementedError

    def register_kv_caches(self, kv_cache: Any) -> None:
        ep = self.endpoint
        self.transport = t = make_transport(
            f"{ep.engine_id}-tp{self.tp_rank}", kv_cache, self.spec.bytes_per_block,
            backends=self.backends, fault_injection=self.fault_injection,
            engine_id=ep.engine_id, block_size=self.spec.block_size, compat_hash=self.compat,
            tp_rank=self.tp_rank, tp_size=self.tp_size, layout=self.layout,
        )
        meta = t.local_metadata()
        self.side_channel = SideChannelServer(ep.host, ep.port, lambda: meta, self.security)
        self.side_channel.start()
        ep.port = self.side_channel.port
        wake, clock = threading.Event(), time.monotonic
        if self.prune_idle_peers:
            peers = Peers(self._fetch, t.add_peer, wake, clock, remove_peer=t.remove_peer,
                          unbind=t.unbind, refused=t.count_refused,
                          idle_after=max(self.lease, 2 * self.hb_interval))
        else:
            peers = Peers(self._fetch, t.add_peer, wake, clock, unbind=t.unbind,
                          refused=t.count_refused)
        self.thread = self.make_thread(t, peers, wake, clock)
        self.side_channel.on_poke = self.thread.poke
        self.thread.start()
        logger.info("%s connector %s ready: side channel %s:%d", self.mode, ep.engine_id,
                    ep.host, ep.port)

    def _fetch(self, host: str, port: int, tp_rank: int | None = None) -> Any:
        """A peer's agent metadata (on a Peers executor thread): of TP rank `tp_rank`, by
        default ours (same-size TP pairs rank with rank); the side channel must serve it."""
        with self.refused_handshakes:
            return fetch_peer_metadata(
                host, port, self.compat, _HANDSHAKE_TIMEOUT_S,
                tp_rank=self.tp_rank if tp_rank is None else tp_rank, security=self.security,
                client_id=self.transport.name if self.transport is not None else "")

    def binding(self) -> KVBinding | None:
        """The engine id and the side channel this rank serves, once bound (the port an
        ephemeral kv_port got is known only now)."""
        if self.side_channel is None:
            return None
        ep = self.endpoint
        return KVBinding(tp_rank=self.tp_rank, engine_id=ep.engine_id, host=ep.host,
                         port=ep.port)

    def start_load_kv(self, metadata: KVConnectorMetadata | None) -> None:
        if self.thread is not None and metadata is not None and metadata.brings_work():
            self.thread.submit(metadata)

    def set_wakeup(self, wake: Callable[[], None]) -> bool:
        """The transfer thread calls `wake` each time it publishes (engine-core process)."""
        if self.thread is None:
            return False
        self.thread.on_publish = wake
        return True

    def get_finished(self) -> KVConnectorOutput:
        if self.thread is None:
            return KVConnectorOutput()
        self.thread.wake.set()
        return self.thread.collect()

    def get_stats(self) -> dict[str, float]:
        if self.thread is None:
            return {}
        stats = self.thread.counters()
        stats["kv_malformed_notifs_total"] = self.thread.malformed
        stats["kv_handshake_refused_total"] = self.refused_handshakes.count
        if self.transport is not None:
            stats["kv_refused_peers_total"] = self.transport.refused_peers
        if self.side_channel is not None:
            stats["kv_malformed_side_channel_total"] = self.side_channel.malformed_count
            stats["kv_side_channel_refused_total"] = self.side_channel.refused_count
            stats["kv_pokes_received_total"] = self.side_channel.poked_count
        return stats

    def table_sizes(self) -> dict[str, int]:
        if self.thread is None or self.transport is None:
            return {}
        return {**self.thread.source.table_sizes(), **self.thread.sink.table_sizes(),
                **self.thread.peers.table_sizes(), "nixl_agents": len(self.transport.peers())}

    def shutdown(self) -> None:
        if self.thread is not None:
            self.thread.stop()
            self.thread.peers.shutdown()
        if self.side_channel is not None:
            self.side_channel.stop()
        if self.transport is not None:
            self.transport.shutdown()
