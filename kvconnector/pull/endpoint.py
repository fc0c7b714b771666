"""This engine's pull coordinates: engine id and side-channel host/port.

The scheduler half advertises them in P's kv_transfer_params; the worker half binds the
side channel. `make_connector` hands both halves the same EngineConfig object, so they
meet here, keyed by that object. A config without an engine id gets one random id (the
same for both halves); a side-channel port of 0 is filled in once the worker has bound it.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass
from typing import Any

_lock = threading.Lock()
_by_config: dict[int, tuple[Any, Endpoint]] = {}


@dataclass
class Endpoint:
    engine_id: str
    host: str
    port: int  # 0 until the worker bound an ephemeral port


def endpoint_for(config: Any) -> Endpoint:
    """The endpoint of the engine built from `config` (created on first use)."""
    kv = config.kv_transfer_config
    with _lock:
        entry = _by_config.get(id(config))
        if entry is None or entry[0] is not config:
            entry = (config, Endpoint(kv.engine_id or uuid.uuid4().hex[:12], kv.kv_host,
                                      kv.kv_port))
            _by_config[id(config)] = entry
        return entry[1]


def forget(config: Any) -> None:
    with _lock:
        entry = _by_config.get(id(config))
        if entry is not None and entry[0] is config:
            del _by_config[id(config)]
