"""NixlPushConnector: P writes its prefill KV straight into D's preallocated blocks.

Assembly only: the scheduler half is `PushScheduler`; the worker half is the shared
`NixlWorker` shell with push mode's halves (`Sender` for P, `Receiver` for D) on the
`nixl-push-transfer` thread.
"""

from __future__ import annotations

import os
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


# P's transfer thread runs its WRITEs' copies (UCX's single-copy path copies in the posting
# thread). At equal priority on P's cores that copy competes with P's API server sending the
# token the same step produced: a loaded P gave that token 6-50 ms late at 1024 tokens on one
# pinned core. Niced, the copy yields to it and still gets every idle cycle.
WRITER_NICE_ENV = "PDSERVE_KV_WRITER_NICE"
DEFAULT_WRITER_NICE = 10


def writer_nice(kv_role: str) -> int:
    """The niceness of a push transfer thread: DEFAULT_WRITER_NICE on a prefill-only engine
    (kv_producer; D's thread wakes its engine when KV lands and stays at 0), else 0;
    $PDSERVE_KV_WRITER_NICE (0-19) overrides it on either role."""
    raw = os.environ.get(WRITER_NICE_ENV)
    if raw is not None:
        try:
            value = int(raw)
        except ValueError:
            value = -1
        if not 0 <= value <= 19:
            raise ValueError(f"{WRITER_NICE_ENV} must be an integer 0-19, not {raw!r}")
        return value
    return DEFAULT_WRITER_NICE if kv_role == "kv_producer" else 0


class PushWorker(NixlWorker):
    mode = "push"
    prune_idle_peers = True
    meta_type = PushMeta

    def __init__(self, config: EngineConfig, spec: KVCacheSpec,
                 endpoint: Endpoint | None = None, tp_rank: int = 0) -> None:
        super().__init__(config, spec, endpoint, tp_rank)
        self.unknown_timeout = unknown_transfer_timeout(config)
        self.writer_nice = writer_nice(config.kv_transfer_config.kv_role)

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
        thread = PushThread(transport, peers, sender, receiver, wake, clock)
        thread.nice = self.writer_nice
        return thread


def make_worker(config: EngineConfig, spec: KVCacheSpec, tp_rank: int) -> PushWorker:
    """The worker half of one tensor-parallel rank, built in that rank's worker process."""
    return PushWorker(config, spec, Endpoint.from_config(config.kv_transfer_config), tp_rank)


def make_scheduler(config: EngineConfig, spec: KVCacheSpec) -> PushScheduler:
    """The scheduler half alone (EngineCore with tensor parallel: the worker halves live in
    the worker processes)."""
    return PushScheduler(config, spec)
