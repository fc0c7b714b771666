"""NixlPushConnector: P writes its prefill KV straight into D's preallocated blocks.

Assembly only: the scheduler half is `PushScheduler`; the worker half is the shared
`NixlWorker` shell with push mode's halves (`Sender` for P, `Receiver` for D) on the
`nixl-push-transfer` thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from engine.config import EngineConfig
from engine.connector_api import KVCacheSpec
from engine.models.formats import load_arch
from kvconnector.endpoint import Endpoint
from kvconnector.nixl import NixlTransport
from kvconnector.params import PushDecodeLeg, decode
from kvconnector.peers import Peers
from kvconnector.push.meta import PushMeta
from kvconnector.push.receiver import Receiver
from kvconnector.push.scheduler import PushScheduler
from kvconnector.push.sender import Sender, SenderStats
from kvconnector.push.thread import PushThread
from kvconnector.security import KVSecurity
from kvconnector.worker import NixlWorker

__all__ = ["PushWorker", "make_scheduler", "make_worker", "request_params_validator"]


DEFAULT_UNKNOWN_TRANSFER_TIMEOUT_S = 10.0
# Fields of a pull-mode D leg (P's answer) that mean nothing to a push D: a leg carrying one
# was meant for a pull deployment (or made up) and is refused at admission.
# Not remote_request_id: vLLM's push proxy names P's request id in the D leg (matching by
# request id when there is no transfer_id).
PULL_ONLY_FIELDS = ("remote_block_ids", "num_prompt_tokens", "lease_expires_at", "signature")


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
        return PushThread(transport, peers, sender, receiver, wake, clock)


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
    security = KVSecurity.from_config(config.kv_transfer_config, warn=False)

    def validate(params: dict[str, Any], prompt_token_ids: Sequence[int]) -> None:
        leg = decode(params, "push")
        if isinstance(leg, PushDecodeLeg):
            refuse_pull_fields(params)
            security.check_side_channel(leg.remote_host, leg.remote_port)  # before any dial
            if leg.tp_size != tp_size:
                check_tp_pair(leg.tp_size, tp_size, kv_heads)

    return validate


def refuse_pull_fields(params: dict[str, Any]) -> None:
    """A push D leg carrying a pull-mode field (P's answer naming its blocks) is a 400 naming
    it: a push D would register with P under an id no P request has and wait for nothing."""
    pull = next((name for name in PULL_ONLY_FIELDS if name in params), None)
    if pull is not None:
        raise ValueError(f"kv_transfer_params.{pull}: a pull-mode field; this decode engine "
                         f"runs push mode, where the prefill engine writes the KV: a D leg "
                         f"names the prefill engine and a transfer_id only")


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
