"""The interface every EngineCore client offers the frontend."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from engine.protocol import EngineCoreOutputs, EngineCoreRequest


class EngineDeadError(RuntimeError):
    """The EngineCore died; every in-flight request fails with this."""

    def __init__(self, message: str = "EngineCore died unexpectedly") -> None:
        super().__init__(message)


class EngineCoreClient(ABC):
    """Frontend → EngineCore. Sync methods for LLMEngine; `*_async` ones for AsyncLLM."""

    num_kv_blocks: int = 0

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """Next batch of outputs (blocks until there is one)."""

    @abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any: ...

    @abstractmethod
    def shutdown(self) -> None: ...

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    async def get_output_async(self) -> EngineCoreOutputs:
        raise NotImplementedError

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        raise NotImplementedError
