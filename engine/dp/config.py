"""Validation of the data-parallel settings and the config each rank's engine gets."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import EngineConfig

PD_WITH_DP_ERROR = "P/D with data_parallel_size > 1 is not supported yet"


def validate_dp(config: EngineConfig) -> None:
    size, rank = config.data_parallel_size, config.data_parallel_rank
    if size < 1:
        raise ValueError(f"data_parallel_size must be at least 1, got {size}")
    if rank is not None and not 0 <= rank < size:
        raise ValueError(f"data_parallel_rank {rank} is out of range for "
                         f"data_parallel_size {size}")
    if config.data_parallel_external_lb:
        if rank is None:
            raise ValueError("data_parallel_external_lb needs data_parallel_rank (the rank "
                             "this server runs)")
        if config.data_parallel_lockstep:
            raise ValueError("data_parallel_lockstep is not supported with "
                             "data_parallel_external_lb")
        return
    if size > 1 and config.kv_transfer_config is not None:
        raise ValueError(f"{PD_WITH_DP_ERROR} (a kv-transfer config was given with "
                         f"data_parallel_size {size}; run one server per rank with "
                         "--data-parallel-external-lb instead)")
    if config.data_parallel_lockstep and size < 2:
        raise ValueError("data_parallel_lockstep needs data_parallel_size > 1")


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
    `_dp<rank>` so every rank's side channel has its own identity."""
    kv = config.kv_transfer_config
    if kv is not None and kv.engine_id and config.data_parallel_size > 1:
        kv = dataclasses.replace(kv, engine_id=f"{kv.engine_id}_dp{rank}")
    return dataclasses.replace(config, data_parallel_rank=rank, kv_transfer_config=kv)


def check_request_rank(config: EngineConfig, rank: int | None) -> None:
    """A request's `data_parallel_rank` must name a rank this server runs."""
    if rank is None:
        return
    ranks = local_ranks(config)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank not in ranks:
        raise ValueError(f"data_parallel_rank {rank!r} is out of range: this server runs "
                         f"data-parallel rank(s) {ranks} (data_parallel_size "
                         f"{config.data_parallel_size})")
