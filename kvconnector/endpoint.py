"""This engine's KV coordinates: engine id and side-channel host/port.

One `Endpoint` per engine, made by the connector's `make` and handed to both halves: the
worker half binds the side channel there (filling in `port` when the config asked for an
ephemeral one), the scheduler half advertises it (pull: in P's kv_transfer_params). Written
once, on the engine-core thread while the worker registers its caches, before the scheduler
half reads it.
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
