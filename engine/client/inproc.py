"""In-process client: the EngineCore runs on the caller's thread, one step per get_output."""

from __future__ import annotations

from typing import Any

from engine.client.base import SyncEngineCoreClient
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.protocol import EngineCoreOutputs, EngineCoreRequest

_UTILITIES = ("reset_prefix_cache", "get_supported_tasks", "get_stats", "debug_prompt_kv",
              "kv_bindings")


class InprocClient(SyncEngineCoreClient):
    def __init__(self, config: EngineConfig) -> None:
        self.core = EngineCore(config)
        self.num_kv_blocks = self.core.num_kv_blocks

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        if not self.core.has_work():
            return EngineCoreOutputs()
        return self.core.step()

    def call_utility(self, method: str, *args: Any) -> Any:
        if method not in _UTILITIES:
            raise ValueError(f"unknown utility method {method!r}")
        return getattr(self.core, method)(*args)

    def shutdown(self) -> None:
        self.core.shutdown()
