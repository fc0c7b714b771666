"""Frozen engine configuration. Validated once in __post_init__; never mutated after start."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.connector_registry import spec_for
from engine.kv_events import KVEventsConfig
from engine.kv_transfer_config import KVTransferConfig

_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs to start. Names match the CLI flags (snake_case).

    `model` is a local Hugging Face directory, a `.gguf` file, or a packaged alias
    (engine.models.source); an alias is resolved here to its file's path, so every process
    started from this config sees a path, and the alias stays the served model name.
    """

    model: str
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    served_model_name: str | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gib: float | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    kv_transfer_config: KVTransferConfig | None = None
    kv_events_config: KVEventsConfig | None = None  # vLLM's --kv-events-config (JSON)
    # Data parallel (engine/dp/ runs it): engines per server, this server's rank
    # behind an external balancer, and whether engines must step in lockstep (waves).
    data_parallel_size: int = 1
    data_parallel_rank: int | None = None
    data_parallel_external_lb: bool = False
    data_parallel_lockstep: bool = False
    # Deadlines on waits that cross a process (engine/core/liveness.py, startup.py): a core
    # or TP worker silent for heartbeat_timeout_s is hung (stopped, frozen); a step that has
    # not returned after step_timeout_s is stuck; each start-up stage has its own deadline
    # (startup_stage_timeout_s, when given, replaces every one of them; as {stage: seconds}
    # only the stages it names).
    heartbeat_timeout_s: float = 30.0
    step_timeout_s: float = 900.0
    startup_stage_timeout_s: float | dict[str, float] | None = None

    def __post_init__(self) -> None:
        from engine.models.source import resolve_model

        resolved = resolve_model(self.model)
        if resolved != self.model:
            if self.served_model_name is None:
                object.__setattr__(self, "served_model_name", self.model)
            object.__setattr__(self, "model", resolved)
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be at least 2, got {self.num_kv_blocks}")
        if self.num_kv_blocks is not None and self.kv_cache_memory_gib is not None:
            raise ValueError("give num_kv_blocks or kv_cache_memory_gib, not both")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1, got "
                             f"{self.tensor_parallel_size}")
        for name in ("heartbeat_timeout_s", "step_timeout_s", "startup_stage_timeout_s"):
            value = getattr(self, name)
            values = value.values() if isinstance(value, dict) else [value]
            if any(v is not None and not v > 0 for v in values):
                raise ValueError(f"{name} must be positive, got {value}")
        if isinstance(self.kv_transfer_config, (str, dict)):
            object.__setattr__(
                self, "kv_transfer_config", KVTransferConfig.from_json(self.kv_transfer_config)
            )
        if isinstance(self.kv_events_config, (str, dict)):
            object.__setattr__(
                self, "kv_events_config", KVEventsConfig.from_json(self.kv_events_config))
        _validate_dp(self)
        spec = spec_for(self)  # an unknown connector is a ValueError naming the known ones
        if spec is not None:
            spec.validate(self)  # its own rules (tensor/data parallel, ports, engine id)

    def resolved_max_model_len(self, max_position_embeddings: int) -> int:
        """The context limit: --max-model-len, capped by what the model's positions allow."""
        if self.max_model_len is None:
            return max_position_embeddings
        if self.max_model_len > max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {max_position_embeddings}"
            )
        return self.max_model_len

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(model=model, **kwargs)


def _validate_dp(config: EngineConfig) -> None:
    """The data-parallel settings (engine/dp/: the rest of data parallel)."""
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
