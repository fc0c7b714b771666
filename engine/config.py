"""Frozen engine configuration. Validated once in __post_init__; never mutated after start."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    """Same shape users know from vLLM's --kv-transfer-config."""

    kv_connector: str
    kv_role: str = "kv_both"
    engine_id: str = ""
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_role not in _ROLES:
            raise ValueError(f"kv_role must be one of {_ROLES}, got {self.kv_role!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_connector_extra_config must be a JSON object")

    @classmethod
    def from_json(cls, text: str | dict | None) -> KVTransferConfig | None:
        if text is None or text == "":
            return None
        data = json.loads(text) if isinstance(text, str) else dict(text)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown kv-transfer-config field(s): {', '.join(unknown)}")
        if "kv_connector" not in data:
            raise ValueError("kv-transfer-config needs kv_connector")
        return cls(**data)

    def extra(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


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
    # Data parallel (engine/dp/config.py validates): engines per server, this server's rank
    # behind an external balancer, and whether engines must step in lockstep (waves).
    data_parallel_size: int = 1
    data_parallel_rank: int | None = None
    data_parallel_external_lb: bool = False
    data_parallel_lockstep: bool = False
    # Deadlines on waits that cross a process (engine/core/liveness.py, startup.py): a core
    # or TP worker silent for heartbeat_timeout_s is hung (stopped, frozen); a step that has
    # not returned after step_timeout_s is stuck; each start-up stage has its own deadline
    # (startup_stage_timeout_s, when given, replaces every one of them).
    heartbeat_timeout_s: float = 30.0
    step_timeout_s: float = 900.0
    startup_stage_timeout_s: float | None = None

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
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if isinstance(self.kv_transfer_config, (str, dict)):
            object.__setattr__(
                self, "kv_transfer_config", KVTransferConfig.from_json(self.kv_transfer_config)
            )
        kv = self.kv_transfer_config
        if self.tensor_parallel_size > 1 and kv is not None:
            if kv.kv_connector != "NixlPushConnector":
                raise ValueError(f"{kv.kv_connector} (pull mode) with tensor_parallel_size > 1 "
                                 "is not supported yet; use NixlPushConnector (push mode)")
            if not kv.kv_port:
                raise ValueError("P/D with tensor_parallel_size > 1 needs an explicit kv_port "
                                 "(rank r serves its side channel at kv_port + r)")
            if not kv.engine_id:
                raise ValueError("P/D with tensor_parallel_size > 1 needs an explicit engine_id "
                                 "(every rank's NIXL agent is named <engine_id>-tp<rank>)")
        if self.tensor_parallel_size > 1 and self.data_parallel_size > 1 and kv is not None:
            raise ValueError("P/D with both tensor_parallel_size > 1 and data_parallel_size > 1 "
                             "is not supported yet (both put ranks at kv_port + rank)")
        from engine.dp.config import validate_dp

        validate_dp(self)

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
