"""NixlPushConnector: P writes its prefill KV straight into D's preallocated blocks.

Assembly only: the scheduler half is `PushScheduler`; the worker half is the shared
`NixlWorker` shell with push mode's halves (`Sender` for P, `Receiver` for D) on the
`nixl-push-transfer` thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from engine.config import EngineConfig
from engine.connector_api import KVCacheSpec
from kvconnector.endpoint import Endpoint
from kvconnector.nixl import NixlTransport
from kvconnector.peers import Peers
from kvconnector.poke import Poker
from kvconnector.push.meta import PushMeta
from kvconnector.push.receiver import Receiver
from kvconnector.push.scheduler import PushScheduler
from kvconnector.push.sender import Sender, SenderStats
from kvconnector.push.thread import PushThread
from kvconnector.worker import NixlWorker

__all__ = ["PushWorker", "make_scheduler", "make_worker"]


DEFAULT_UNKNOWN_TRANSFER_TIMEOUT_S = 10.0


def unknown_transfer_timeout(config: EngineConfig) -> float:
    """`push_unknown_transfer_timeout` (seconds): how long P holds a registration for a
    transfer none of its requests carries before it answers PUSH_FAIL (docs/security.md)."""
    kv = config.kv_transfer_config
    assert kv is not None
    value = kv.extra("push_unknown_transfer_timeout", DEFAULT_UNKNOWN_TRANSFER_TIMEOUT_S)
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            0 < value < float("inf")):
        raise ValueError(f"push_unknown_transfer_timeout must be a positive number of seconds, "
                         f"not {value!r}")
    return float(value)


class PushWorker(NixlWorker):
    mode = "push"
    prune_idle_peers = True
    meta_type = PushMeta

    def __init__(self, config: EngineConfig, spec: KVCacheSpec,
                 endpoint: Endpoint | None = None, tp_rank: int = 0) -> None:
        super().__init__(config, spec, endpoint, tp_rank)
        self.unknown_timeout = unknown_transfer_timeout(config)

    def make_thread(self, transport: NixlTransport, peers: Peers, wake: threading.Event,
                    clock: Callable[[], float]) -> PushThread:
        ep = self.endpoint
        sender = Sender(transport, peers, clock, lease=self.lease, ttl=self.ttl,
                        tp_size=self.tp_size, bytes_per_block=self.spec.bytes_per_block,
                        stats=SenderStats(), num_blocks=transport.num_blocks,
                        tp_rank=self.tp_rank, unknown_timeout=self.unknown_timeout)
        # D's rank r registers with, and heartbeats, every P rank holding heads of rank r,
        # at that P rank's side channel (docs/design.md §8)
        identity = {"decode_engine_id": ep.engine_id, "decode_host": ep.host,
                    "decode_port": ep.port, "decode_tp_size": self.tp_size,
                    "decode_tp_rank": self.tp_rank}
        receiver = Receiver(transport, peers, clock, identity=identity, ttl=self.ttl,
                            hb_interval=self.hb_interval, grace=self.lease / 6,
                            stats={"kv_push_registrations_sent_total": 0,
                                   "kv_peer_gone_total": 0,
                                   "kv_push_cancel_acks_received_total": 0},
                            tp_rank=self.tp_rank, tp_size=self.tp_size)
        sender.poker = Poker()
        return PushThread(transport, peers, sender, receiver, wake, clock)


def make_worker(config: EngineConfig, spec: KVCacheSpec, tp_rank: int) -> PushWorker:
    """The worker half of one tensor-parallel rank, built in that rank's worker process."""
    return PushWorker(config, spec, Endpoint.from_config(config.kv_transfer_config), tp_rank)


def make_scheduler(config: EngineConfig, spec: KVCacheSpec) -> PushScheduler:
    """The scheduler half alone (EngineCore with tensor parallel: the worker halves live in
    the worker processes)."""
    return PushScheduler(config, spec)
