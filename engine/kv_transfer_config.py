"""The kv-transfer part of the engine config (`--kv-transfer-config`): which connector, this
engine's role and KV coordinates, and the connector's own keys. Frozen, validated once; the
connector's spec (engine.connector_api.ConnectorSpec) checks what only it knows."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

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
