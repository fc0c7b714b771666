"""Data parallel: the ranks a server runs, the config each rank's engine gets, and the rank a
request runs on. (`EngineConfig` validates the data-parallel settings themselves.)"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.config import EngineConfig
from engine.connector_registry import spec_for


def uses_dp_client(config: EngineConfig) -> bool:
    """True when one frontend drives several engines (internal load balancing)."""
    return config.data_parallel_size > 1 and not config.data_parallel_external_lb


def local_ranks(config: EngineConfig) -> list[int]:
    """The DP ranks whose engines this server runs."""
    if config.data_parallel_external_lb:
        return [int(config.data_parallel_rank or 0)]
    return list(range(config.data_parallel_size))


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config of rank `rank`'s engine: its rank set, a given KV engine id suffixed
    `_dp<rank>` and a given side-channel port moved to the rank's own (the connector's port
    layout: its tensor-parallel ranks follow it), so every rank's side channel and NIXL agent
    has its own identity and address (an external-LB server runs one rank: its port stays)."""
    kv = config.kv_transfer_config
    spec = spec_for(config)
    if kv is not None and spec is not None and config.data_parallel_size > 1:
        shift = kv.kv_port and not config.data_parallel_external_lb
        port = (spec.side_channel_port(kv.kv_port, rank, 0, config.tensor_parallel_size)
                if shift else kv.kv_port)
        kv = dataclasses.replace(
            kv, engine_id=f"{kv.engine_id}_dp{rank}" if kv.engine_id else "", kv_port=port)
    return dataclasses.replace(config, data_parallel_rank=rank, kv_transfer_config=kv)


def default_request_rank(config: EngineConfig, kv_transfer_params: Any) -> int | None:
    """The rank an unpinned request must run on, None when the balancer may pick. A prefill
    leg of a connector that pins them goes to rank 0 — the rank the top level of
    /kv_transfer/info names, so a rank-unaware proxy that sent D there gets a P that writes;
    a rank-aware proxy pins the rank it named in D's leg (design §9)."""
    spec = spec_for(config)
    if (spec is None or not spec.pins_prefill_leg or not uses_dp_client(config)
            or not spec.is_prefill_leg(kv_transfer_params)):
        return None
    return 0


def check_request_rank(config: EngineConfig, rank: int | None) -> None:
    """A request's `data_parallel_rank` must name a rank this server runs."""
    if rank is None:
        return
    ranks = local_ranks(config)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank not in ranks:
        raise ValueError(f"data_parallel_rank {rank!r} is out of range: this server runs "
                         f"data-parallel rank(s) {ranks} (data_parallel_size "
                         f"{config.data_parallel_size})")
