"""SyncBridgeClient: the blocking client interface over an asyncio client.

`LLM(data_parallel_size=N)` drives N engines through the same DPLBAsyncClient the servers
use; this adapter runs it on a private event loop thread ("SyncBridgeLoop") and blocks on
each call. Any thread may call it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

from engine.client.base import AsyncEngineCoreClient, SyncEngineCoreClient
from engine.protocol import EngineCoreOutputs, EngineCoreRequest


class SyncBridgeClient(SyncEngineCoreClient):
    def __init__(self, inner: AsyncEngineCoreClient) -> None:
        self.inner = inner
        self.num_kv_blocks = inner.num_kv_blocks
        self.max_model_len = getattr(inner, "max_model_len", None)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="SyncBridgeLoop")
        self._thread.start()

    def _call(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    @property
    def dead_error(self) -> Any:
        return getattr(self.inner, "dead_error", None)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._call(self.inner.add_request_async(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        self._call(self.inner.abort_requests_async(request_ids))

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        return self._call(self.inner.get_output_async(), timeout)

    def call_utility(self, method: str, *args: Any) -> Any:
        return self._call(self.inner.call_utility_async(method, *args))

    def shutdown(self) -> None:
        self.inner.shutdown()
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
