"""The interface every EngineCore client offers the frontend."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import Any

from engine.protocol import EngineCoreOutputs, EngineCoreRequest


class EngineDeadError(RuntimeError):
    """The EngineCore died; every in-flight request fails with this."""

    def __init__(self, message: str = "EngineCore died unexpectedly") -> None:
        super().__init__(message)


async def next_output(outputs: asyncio.Queue[Any]) -> EngineCoreOutputs:
    """The next item of an async client's output queue. An EngineDeadError put there is
    sticky: it goes back for the next waiter and is raised to this one."""
    item = await outputs.get()
    if isinstance(item, EngineDeadError):
        outputs.put_nowait(item)
        raise EngineDeadError(str(item))
    return item


class EngineCoreClient(ABC):
    """Frontend → EngineCore: what every client offers. A client is either blocking
    (`SyncEngineCoreClient`, for LLMEngine) or asyncio (`AsyncEngineCoreClient`, for
    AsyncLLM), never both."""

    num_kv_blocks: int = 0

    @abstractmethod
    def shutdown(self) -> None: ...


class SyncEngineCoreClient(EngineCoreClient):
    """Blocking client; its methods are called from the frontend's one thread."""

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """Next batch of outputs (blocks until there is one)."""

    @abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any: ...


class AsyncEngineCoreClient(EngineCoreClient):
    """asyncio client; its coroutines run on the frontend's event loop."""

    @abstractmethod
    async def add_request_async(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    async def abort_requests_async(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    async def get_output_async(self) -> EngineCoreOutputs:
        """Next batch of outputs (waits until there is one)."""

    @abstractmethod
    async def call_utility_async(self, method: str, *args: Any) -> Any: ...
