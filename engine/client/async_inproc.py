"""AsyncInprocClient: the asyncio client with the EngineCore on a thread of this process.

For `AsyncLLM.from_config(config, multiprocess=False)` (tests, debugging): the same busy loop
as the core process (`EngineCoreLoop`) runs on "EngineCoreThread"; requests go straight onto
its input queue; "EngineCoreOutputForwarder" hands outputs to the event loop. No sockets, no
serialization. Death semantics match AsyncMPClient: a fatal error in the busy loop fails
every waiter with EngineDeadError, and every later call raises it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from typing import Any

from engine.client.base import AsyncEngineCoreClient, EngineDeadError, next_output
from engine.client.mp_base import UtilityCallError
from engine.config import EngineConfig
from engine.core.busy_loop import EngineCoreLoop, InputKind
from engine.core.engine_core import EngineCore
from engine.core.messages import UtilityCall
from engine.protocol import EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger(__name__)


class _Stopped:
    def __init__(self, error: EngineDeadError) -> None:
        self.error = error


class AsyncInprocClient(AsyncEngineCoreClient):
    def __init__(self, config: EngineConfig, *, shutdown_timeout_s: float = 5.0) -> None:
        core = EngineCore(config)
        self.num_kv_blocks = core.num_kv_blocks
        self.max_model_len = core.max_model_len
        self.shutdown_timeout_s = shutdown_timeout_s
        self.engine = EngineCoreLoop(core, drain_timeout_s=shutdown_timeout_s)
        self._call_ids = itertools.count(1)
        self._dead: EngineDeadError | None = None
        self._dead_delivered = False
        self._shut_down = False
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._bound = threading.Event()
        self._outputs: asyncio.Queue[EngineCoreOutputs | EngineDeadError] | None = None
        self._utility_results: dict[int, asyncio.Future] = {}
        self._core_thread = threading.Thread(target=self._run_core, name="EngineCoreThread",
                                             daemon=True)
        self._forwarder = threading.Thread(target=self._forward, daemon=True,
                                           name="EngineCoreOutputForwarder")
        self._core_thread.start()
        self._forwarder.start()

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead

    # -- core thread / forwarder thread -------------------------------------------------
    def _run_core(self) -> None:
        error = EngineDeadError("the engine client was shut down")
        try:
            self.engine.run()
        except Exception as e:
            logger.exception("in-process engine core: fatal error in the busy loop")
            error = EngineDeadError(f"engine core hit a fatal error: {type(e).__name__}: {e}")
        finally:
            try:
                self.engine.core.shutdown()
            finally:
                self.engine.output_queue.put_nowait(_Stopped(error))

    def _forward(self) -> None:
        while True:
            item = self.engine.output_queue.get()
            if not self._bound.is_set():
                if isinstance(item, _Stopped):
                    self._dead = self._dead or item.error
                    return
                self._bound.wait()
            loop = self._aloop
            if loop is None or loop.is_closed():
                return
            if isinstance(item, _Stopped):
                loop.call_soon_threadsafe(self._mark_dead, item.error)
                return
            loop.call_soon_threadsafe(self._dispatch, item)

    # -- event-loop side ---------------------------------------------------------------
    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._aloop is None:
            self._aloop = loop
            self._outputs = asyncio.Queue()
            if self._dead is not None:
                self._mark_dead(self._dead)
            self._bound.set()
        elif loop is not self._aloop:
            raise RuntimeError("AsyncInprocClient is bound to another event loop")

    def _dispatch(self, outputs: EngineCoreOutputs) -> None:
        if outputs.utility_output is not None:
            fut = self._utility_results.pop(outputs.utility_output.call_id, None)
            if fut is not None and not fut.done():
                fut.set_result(outputs.utility_output)
        if (outputs.outputs or outputs.finished_requests) and self._outputs is not None:
            self._outputs.put_nowait(outputs)

    def _mark_dead(self, error: EngineDeadError) -> None:
        """Event-loop thread only."""
        self._dead = self._dead or error
        for fut in self._utility_results.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(str(self._dead)))
        self._utility_results.clear()
        if self._outputs is not None and not self._dead_delivered:
            self._dead_delivered = True
            self._outputs.put_nowait(self._dead)

    def _ensure_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._start()
        self._ensure_alive()
        self.engine.input_queue.put_nowait((InputKind.ADD, request))

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self._start()
        if request_ids and self._dead is None:
            ids = list(request_ids)
            self.engine.aborts_queue.put_nowait(ids)
            self.engine.input_queue.put_nowait((InputKind.ABORT, ids))

    async def get_output_async(self) -> EngineCoreOutputs:
        self._start()
        assert self._outputs is not None
        return await next_output(self._outputs)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        self._start()
        self._ensure_alive()
        assert self._aloop is not None
        call_id = next(self._call_ids)
        fut: asyncio.Future = self._aloop.create_future()
        self._utility_results[call_id] = fut
        self.engine.input_queue.put_nowait(
            (InputKind.UTILITY, UtilityCall(call_id, method, list(args))))
        try:
            out = await fut
        finally:
            self._utility_results.pop(call_id, None)
        if out.failure_message is not None:
            raise UtilityCallError(f"utility {method} failed in the engine core: "
                                   f"{out.failure_message}")
        return out.result

    def shutdown(self) -> None:
        """Stop the busy loop (in-flight requests get `shutdown_timeout_s` to finish)."""
        if self._shut_down:
            return
        self._shut_down = True
        self.engine.request_shutdown()
        self._core_thread.join(self.shutdown_timeout_s + 5.0)
        if self._core_thread.is_alive():
            logger.error("in-process engine core did not stop within %.0fs",
                         self.shutdown_timeout_s + 5.0)
        self._bound.set()
        self._forwarder.join(1.0)
        error = EngineDeadError("the engine client was shut down")
        loop = self._aloop
        if loop is not None and not loop.is_closed() and loop.is_running():
            loop.call_soon_threadsafe(self._mark_dead, error)
        self._dead = self._dead or error
