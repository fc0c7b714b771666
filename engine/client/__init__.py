"""EngineCore clients. `make_client` picks one for the frontend."""

from __future__ import annotations

from typing import Any

from engine.client.base import EngineCoreClient, EngineDeadError
from engine.config import EngineConfig

__all__ = ["EngineCoreClient", "EngineDeadError", "make_client"]


def make_client(
    config: EngineConfig, *, multiprocess: bool, asyncio_mode: bool, **kwargs: Any
) -> EngineCoreClient:
    """In-process, sync multiprocess or async multiprocess client; with
    data_parallel_size > 1 (internal balancing) the DP load-balancing client.

    `kwargs` go to the multiprocess clients (use_tcp, host, startup_timeout_s,
    utility_timeout_s, shutdown_timeout_s, engine_index).
    """
    from engine.dp.config import uses_dp_client

    if uses_dp_client(config):
        if not multiprocess:
            raise ValueError("data_parallel_size > 1 needs multiprocess=True (one process "
                             "per engine)")
        from engine.client.dp_lb_client import DPLBAsyncClient

        client = DPLBAsyncClient(config, **kwargs)
        if asyncio_mode:
            return client
        from engine.client.sync_bridge import SyncBridgeClient

        return SyncBridgeClient(client)
    if multiprocess and config.data_parallel_external_lb:
        # External balancing: this server runs rank R's engine only (engine index R).
        kwargs.setdefault("engine_index", int(config.data_parallel_rank or 0))
    if multiprocess:
        from engine.client.async_mp_client import AsyncMPClient
        from engine.client.mp_client import SyncMPClient

        cls = AsyncMPClient if asyncio_mode else SyncMPClient
        return cls(config, **kwargs)
    if asyncio_mode:
        from engine.client.async_inproc import AsyncInprocClient

        return AsyncInprocClient(config)
    from engine.client.inproc import InprocClient

    return InprocClient(config)
