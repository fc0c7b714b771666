"""NixlPushConnector: P writes its prefill KV straight into D's preallocated blocks.

Assembly only: the scheduler half is `PushScheduler`; the worker half is the shared
`NixlWorker` shell with push mode's halves (`Sender` for P, `Receiver` for D) on the
`nixl-push-writer` thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from engine.config import EngineConfig
from engine.kv_connector import KVCacheSpec
from engine.models.arch import load_arch
from kvconnector.endpoint import Endpoint
from kvconnector.nixl import NixlTransport
from kvconnector.params import PushDecodeLeg, decode
from kvconnector.peers import Peers
from kvconnector.push.meta import PushMeta
from kvconnector.push.receiver import Receiver
from kvconnector.push.scheduler import PushScheduler
from kvconnector.push.sender import Sender, SenderStats
from kvconnector.push.writer import PushWriter
from kvconnector.worker import NixlWorker

__all__ = ["PushWorker", "make", "make_scheduler", "make_worker",
           "request_params_validator"]


class PushWorker(NixlWorker):
    mode = "push"
    prune_idle_peers = True
    meta_type = PushMeta

    def make_thread(self, transport: NixlTransport, peers: Peers, wake: threading.Event,
                    clock: Callable[[], float]) -> PushWriter:
        ep = self.endpoint
        sender = Sender(transport, peers, clock, lease=self.lease, ttl=self.ttl,
                        tp_size=self.tp_size, bytes_per_block=self.spec.bytes_per_block,
                        stats=SenderStats(), num_blocks=transport.num_blocks,
                        tp_rank=self.tp_rank)
        # D's rank r registers with, and heartbeats, every P rank holding heads of rank r,
        # at P's kv_port + that rank (docs/design.md §8)
        identity = {"decode_engine_id": ep.engine_id, "decode_host": ep.host,
                    "decode_port": ep.port, "decode_tp_size": self.tp_size,
                    "decode_tp_rank": self.tp_rank}
        receiver = Receiver(transport, peers, clock, identity=identity, ttl=self.ttl,
                            hb_interval=self.hb_interval, grace=self.lease / 6,
                            stats={"kv_push_registrations_sent_total": 0,
                                   "kv_peer_gone_total": 0,
                                   "kv_push_cancel_acks_received_total": 0},
                            tp_rank=self.tp_rank, tp_size=self.tp_size)
        return PushWriter(transport, peers, sender, receiver, wake, clock)


def make(config: EngineConfig, spec: KVCacheSpec) -> tuple[PushScheduler, PushWorker]:
    """Both halves of one engine's connector (`engine.kv_connector.make_connector`)."""
    endpoint = Endpoint.from_config(config.kv_transfer_config)
    return PushScheduler(config, spec), PushWorker(config, spec, endpoint)


def make_worker(config: EngineConfig, spec: KVCacheSpec, tp_rank: int) -> PushWorker:
    """The worker half of one tensor-parallel rank, built in that rank's worker process."""
    return PushWorker(config, spec, Endpoint.from_config(config.kv_transfer_config), tp_rank)


def make_scheduler(config: EngineConfig, spec: KVCacheSpec) -> PushScheduler:
    """The scheduler half alone (EngineCore with tensor parallel: the worker halves live in
    the worker processes)."""
    return PushScheduler(config, spec)


def request_params_validator(config: EngineConfig
                             ) -> Callable[[dict[str, Any], Sequence[int]], None]:
    """The frontend's admission check of a request's kv_transfer_params (HTTP 400)."""

    tp_size = config.tensor_parallel_size
    kv_heads = load_arch(config.model).num_kv_heads

    def validate(params: dict[str, Any], prompt_token_ids: Sequence[int]) -> None:
        leg = decode(params, "push")
        if isinstance(leg, PushDecodeLeg) and leg.tp_size != tp_size:
            check_tp_pair(leg.tp_size, tp_size, kv_heads)

    return validate


def check_tp_pair(p_size: int, d_size: int, kv_heads: int) -> None:
    """Refuse (ValueError naming the field) a P/D pair of TP sizes push cannot pair: one must
    divide the other, and each rank must hold its own KV heads (docs/design.md §8)."""
    where = (f"kv_transfer_params.tp_size: the prefill engine has tensor_parallel_size "
             f"{p_size}, this decode engine {d_size}")
    if max(p_size, d_size) % min(p_size, d_size):
        raise ValueError(f"{where}; push between different sizes needs one to divide the other")
    if kv_heads % max(p_size, d_size):
        raise ValueError(f"{where}; the model's {kv_heads} KV heads do not split over "
                         f"{max(p_size, d_size)} ranks (KV heads replicated over ranks pair "
                         f"only between equal sizes)")
