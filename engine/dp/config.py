"""Validation of the data-parallel settings and the config each rank's engine gets."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from kvconnector.params import PREFILL_FLAG

if TYPE_CHECKING:
    from engine.config import EngineConfig



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
    `_dp<rank>` and a given side-channel port moved up by the rank, so every rank's side
    channel and NIXL agent has its own identity and address (an external-LB server runs
    one rank: its port stays)."""
    kv = config.kv_transfer_config
    if kv is not None and config.data_parallel_size > 1:
        shift = kv.kv_port and not config.data_parallel_external_lb
        kv = dataclasses.replace(
            kv, engine_id=f"{kv.engine_id}_dp{rank}" if kv.engine_id else "",
            kv_port=kv.kv_port + rank if shift else kv.kv_port)
    return dataclasses.replace(config, data_parallel_rank=rank, kv_transfer_config=kv)


def default_request_rank(config: EngineConfig, kv_transfer_params: Any) -> int | None:
    """The rank an unpinned request must run on, None when the balancer may pick. A push-mode
    prefill leg (`do_remote_decode`) goes to rank 0 — the rank the top level of
    /kv_transfer/info names, so a rank-unaware proxy that sent D there gets a P that writes;
    a rank-aware proxy pins the rank it named in D's leg (design §9)."""
    kv = config.kv_transfer_config
    if (kv is None or kv.kv_connector != "NixlPushConnector" or not uses_dp_client(config)
            or not isinstance(kv_transfer_params, dict)
            or kv_transfer_params.get(PREFILL_FLAG) is not True):
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
