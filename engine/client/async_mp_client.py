"""AsyncMPClient: the asyncio client of an EngineCore process (used by AsyncLLM).

asyncio sockets shadow the frontend's sockets; one reader task in the running loop moves
outputs to an asyncio queue and resolves utility futures. The client binds to the first event
loop that calls one of its methods. Death semantics: see `engine.client.mp_client`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import zmq
import zmq.asyncio

from engine.client.base import AsyncEngineCoreClient, EngineDeadError, next_output
from engine.client.mp_base import MPClientBase
from engine.config import EngineConfig
from engine.core.messages import UtilityCall
from engine.protocol import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType

logger = logging.getLogger(__name__)


class AsyncMPClient(MPClientBase, AsyncEngineCoreClient):
    """asyncio client; binds to the first running loop that calls one of its methods."""

    def __init__(self, config: EngineConfig, **kwargs: Any) -> None:
        # Before the core process: its watcher may call _wake_readers at once.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._poll: asyncio.Future | None = None  # the reader's wait for output, while blocked
        super().__init__(config, **kwargs)
        self._in: zmq.asyncio.Socket | None = None
        self._out: zmq.asyncio.Socket | None = None
        self._outputs: asyncio.Queue[EngineCoreOutputs | EngineDeadError] | None = None
        self._utility_results: dict[int, asyncio.Future] = {}
        self._reader_task: asyncio.Task | None = None

    @property
    def dead_error(self) -> EngineDeadError | None:
        # Asked from the event loop (a /health check) before any request: start the reader,
        # which alone reads heartbeats, so a core stopped while idle is noticed too.
        if self._loop is None:
            try:
                self._start()
            except RuntimeError:
                pass  # no running loop here: the first request starts it
        return super().dead_error

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            self._in = zmq.asyncio.Socket.from_socket(self.core.input_socket)
            self._out = zmq.asyncio.Socket.from_socket(self.core.output_socket)
            self._outputs = asyncio.Queue()
            self._reader_task = loop.create_task(
                self._read_outputs(), name=f"EngineCoreOutputReader_{self.engine_index}")
            if self._dead is not None:
                self._outputs.put_nowait(self._dead)
        elif loop is not self._loop:
            raise RuntimeError("AsyncMPClient is bound to another event loop")

    def _wake_readers(self) -> None:
        loop = self._loop
        if loop is None:
            return  # no reader yet: it looks at the exit flag before its first wait
        try:
            loop.call_soon_threadsafe(self._interrupt_poll)
        except RuntimeError:
            pass  # the loop is closed: nobody waits

    def _interrupt_poll(self) -> None:
        """Loop thread: end the reader's wait now (it then looks at the exit flag)."""
        if self._poll is not None and not self._poll.done():
            self._poll.set_result(0)

    async def _read_outputs(self) -> None:
        assert self._out is not None
        sock = self.core.output_socket
        try:
            while self._dead is None:
                ready = 0
                if not self._exited.is_set():
                    self._poll = self._out.poll(timeout=self.reader_timeout_ms())
                    try:
                        ready = await self._poll
                    finally:
                        self._poll = None
                if ready:
                    # Drain everything queued: the socket's FD is edge-triggered, so after
                    # one recv a second queued message would wait for the next arrival (or
                    # the wait's end) and reach the client late, in a burst.
                    while sock.poll(timeout=0):
                        self._dispatch(sock.recv_multipart(copy=False))
                elif self._exited.is_set():
                    while sock.poll(timeout=0):
                        self._dispatch(sock.recv_multipart(copy=False))
                    self._mark_dead(EngineDeadError(self._exit_reason()))
                elif (silent := self.check_silence()) is not None:
                    self._mark_dead(silent)
        except EngineDeadError as e:
            self._mark_dead(e)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if not self._shut_down:
                logger.exception("engine %d: output reader failed", self.engine_index)
                self._mark_dead(EngineDeadError(f"output reader failed: {e}"))

    def _dispatch(self, frames: list[zmq.Frame]) -> None:
        outputs = self._decode(frames)
        if outputs is None:
            return
        if outputs.utility_output is not None:
            fut = self._utility_results.pop(outputs.utility_output.call_id, None)
            if fut is not None and not fut.done():
                fut.set_result(outputs.utility_output)
        if outputs.outputs or outputs.finished_requests:
            assert self._outputs is not None
            self._outputs.put_nowait(outputs)

    def _mark_dead(self, error: EngineDeadError) -> None:
        """Loop thread only (or before the loop is known)."""
        if self._dead is not None:
            return
        self._dead = error
        waiters = list(self._utility_results.values())
        self._utility_results.clear()
        for fut in waiters:
            if not fut.done():
                fut.set_exception(EngineDeadError(str(error)))
        if self._outputs is not None:
            self._outputs.put_nowait(error)

    async def _send(self, kind: EngineCoreRequestType, obj: Any) -> None:
        self._start()
        self._ensure_alive()
        assert self._in is not None
        try:
            await self._in.send_multipart(self._frames(kind, obj), copy=False)
        except zmq.ZMQError as e:
            raise EngineDeadError(f"engine core {self.engine_index} unreachable: {e}") from e

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self._send(EngineCoreRequestType.ADD, request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids:
            await self._send(EngineCoreRequestType.ABORT, list(request_ids))

    async def get_output_async(self) -> EngineCoreOutputs:
        self._start()
        assert self._outputs is not None
        return await next_output(self._outputs)

    async def call_utility_async(self, method: str, *args: Any,
                                 timeout: float | None = None) -> Any:
        self._start()
        self._ensure_alive()
        assert self._loop is not None
        call_id = next(self._call_ids)
        fut: asyncio.Future = self._loop.create_future()
        self._utility_results[call_id] = fut
        try:
            await self._send(EngineCoreRequestType.UTILITY,
                             UtilityCall(call_id, method, list(args)))
            out = await asyncio.wait_for(fut, timeout or self.utility_timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"utility {method} (call {call_id}) got no answer from engine "
                               f"core {self.engine_index} in time") from None
        finally:
            self._utility_results.pop(call_id, None)
        return self._utility_result(method, out)

    def shutdown(self) -> None:
        """Safe from the loop thread, another thread, or after the loop stopped or closed."""
        if self._shut_down:
            return
        self._shut_down = True
        error = EngineDeadError("the engine client was shut down")
        loop = self._loop
        if loop is None or loop.is_closed():
            self._dead = self._dead or error
        elif _in_loop(loop) or not loop.is_running():
            self._mark_dead(error)
        else:
            loop.call_soon_threadsafe(self._mark_dead, error)
        if self._reader_task is not None:
            cancel_task(self._reader_task)
        self.core.shutdown(self.shutdown_timeout_s)
        self.ctx.destroy(linger=0)


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def cancel_task(task: asyncio.Task) -> None:
    """Cancel `task` from any thread; when its loop is stopped, run it to the end now."""
    if task.done():
        return
    loop = task.get_loop()
    if loop.is_closed():
        return
    if _in_loop(loop):
        task.cancel()
    elif loop.is_running():
        loop.call_soon_threadsafe(task.cancel)
    else:
        task.cancel()
        loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
