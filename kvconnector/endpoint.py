"""This engine's KV coordinates: engine id and side-channel host/port.

One `Endpoint` per worker half, made by the connector's `make_worker`: the worker half binds
the side channel there (filling in `port` when the config asked for an ephemeral one) and
reports it as its `KVBinding` through the executor; the scheduler half learns it by
`bind_workers` (pull: advertises it in P's kv_transfer_params), and so does
`/kv_transfer/info`. Written once, by the thread that registers the caches, before the binding
is reported.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any


@dataclass
class Endpoint:
    engine_id: str
    host: str
    port: int  # 0 until the worker bound an ephemeral port

    @classmethod
    def from_config(cls, kv: Any) -> Endpoint:
        """`kv`: the KVTransferConfig. Without an engine id the engine gets a random one."""
        return cls(kv.engine_id or uuid.uuid4().hex[:12], kv.kv_host, kv.kv_port)


def side_channel_port(base: int, dp_rank: int, tp_rank: int, tp_size: int) -> int:
    """The one port layout (docs/design.md §8, §9): data-parallel rank d's tensor-parallel
    rank t serves its side channel at `base + d * tp_size + t`. A DP rank's TP ranks are
    contiguous from its own port, so a D that knows a P rank's `kv_port` dials P's TP rank p
    at `kv_port + p` (`side_channel_port(kv_port, 0, p, …)`). A base of 0 (ephemeral: each
    rank picks a free port) stays 0."""
    if not base:
        return 0
    return base + dp_rank * tp_size + tp_rank
