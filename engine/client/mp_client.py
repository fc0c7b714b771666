"""Clients of an EngineCore running in its own process (ZeroMQ + msgpack).

- `SyncMPClient` (LLM / LLMEngine): a reader thread "EngineCoreOutputReader_<i>" moves
  outputs from the PULL socket to a queue; `get_output()` blocks on it; `call_utility()`
  blocks on a future resolved by the reader.
- `AsyncMPClient` (AsyncLLM, in async_mp_client.py): asyncio sockets and one reader task
  in the running loop; `*_async` methods. It binds to the first event loop that uses it.

Death (invariant 5, nothing hangs): the client notices
- the ENGINE_CORE_DEAD sentinel on the output socket, and
- the core process exiting for any reason (watched through its process sentinel; after
  an exit the reader first drains what the engine sent before dying), and
- the core's silence: no heartbeat for `heartbeat_timeout_s` (stopped or frozen; it is
  killed: mp_base.check_silence).
Then every waiter — `get_output*`, utility calls — raises EngineDeadError at once, and every
later call raises it immediately. `shutdown()` does the same for waiters and leaves no
child process, socket or IPC file behind.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
from typing import Any

import zmq

from engine.client.base import EngineDeadError, SyncEngineCoreClient
from engine.client.mp_base import MPClientBase, UtilityCallError
from engine.config import EngineConfig
from engine.core.messages import UtilityCall
from engine.protocol import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType

__all__ = ["SyncMPClient", "UtilityCallError"]

logger = logging.getLogger(__name__)


class SyncMPClient(MPClientBase, SyncEngineCoreClient):
    """Blocking client. Thread-safe: any thread may add, abort, call utilities or read."""

    def __init__(self, config: EngineConfig, **kwargs: Any) -> None:
        # The reader blocks on the output socket and this pipe; a byte on the pipe says "look
        # at the exit and stop flags" (the process watcher, shutdown). Made before the core
        # process, whose watcher may write to it at once.
        self._wake_r, self._wake_w = os.pipe()
        self._wake_lock = threading.Lock()
        try:
            super().__init__(config, **kwargs)
        except BaseException:
            self._close_wake_pipe()
            raise
        self.outputs_queue: queue.Queue[EngineCoreOutputs | EngineDeadError] = queue.Queue()
        self._utility_results: dict[int, tuple[str, concurrent.futures.Future]] = {}
        self._lock = threading.Lock()  # input socket, encoder, utility table, death
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read_outputs, daemon=True,
                                        name=f"EngineCoreOutputReader_{self.engine_index}")
        self._reader.start()

    def _wake_readers(self) -> None:
        with self._wake_lock:
            if self._wake_w >= 0:
                os.write(self._wake_w, b"x")

    def _read_outputs(self) -> None:
        sock = self.core.output_socket
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(timeout=self.reader_timeout_ms()))
                if sock in ready:
                    self._dispatch(sock.recv_multipart(copy=False))
                elif self._exited.is_set():
                    while sock.poll(timeout=0):
                        self._dispatch(sock.recv_multipart(copy=False))
                    self._mark_dead(EngineDeadError(self._exit_reason()))
                    return
                elif not ready and (silent := self.check_silence()) is not None:
                    self._mark_dead(silent)
                    return
        except EngineDeadError as e:
            self._mark_dead(e)
        except Exception as e:
            if not self._stop.is_set():
                logger.exception("engine %d: output reader failed", self.engine_index)
                self._mark_dead(EngineDeadError(f"output reader failed: {e}"))

    def _dispatch(self, frames: list[zmq.Frame]) -> None:
        outputs = self._decode(frames)
        if outputs is None:
            return
        if outputs.utility_output is not None:
            with self._lock:
                entry = self._utility_results.pop(outputs.utility_output.call_id, None)
            if entry is not None:
                entry[1].set_result(outputs.utility_output)
        if outputs.outputs or outputs.finished_requests:
            self.outputs_queue.put(outputs)

    def _mark_dead(self, error: EngineDeadError) -> None:
        with self._lock:
            if self._dead is not None:
                return
            self._dead = error
            waiters = list(self._utility_results.values())
            self._utility_results.clear()
        for _, fut in waiters:
            fut.set_exception(EngineDeadError(str(error)))
        self.outputs_queue.put(error)

    def _send(self, kind: EngineCoreRequestType, obj: Any) -> None:
        with self._lock:
            self._ensure_alive()
            try:
                self.core.input_socket.send_multipart(self._frames(kind, obj), copy=False)
            except zmq.ZMQError as e:
                raise EngineDeadError(f"engine core {self.engine_index} unreachable: {e}") from e

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(EngineCoreRequestType.ABORT, list(request_ids))

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        """Next batch of outputs; blocks. Raises EngineDeadError (queue.Empty on timeout)."""
        item = self.outputs_queue.get(timeout=timeout)
        if isinstance(item, EngineDeadError):
            self.outputs_queue.put(item)  # every later caller sees it too
            raise EngineDeadError(str(item))
        return item

    def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        call_id = next(self._call_ids)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._ensure_alive()
            self._utility_results[call_id] = (method, fut)
        try:
            self._send(EngineCoreRequestType.UTILITY, UtilityCall(call_id, method, list(args)))
            out = fut.result(timeout=timeout or self.utility_timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"utility {method} (call {call_id}) got no answer from engine "
                               f"core {self.engine_index} in time") from None
        finally:
            with self._lock:
                self._utility_results.pop(call_id, None)
        return self._utility_result(method, out)

    def shutdown(self) -> None:
        if self._shut_down:
            return
        self._shut_down = True
        self._stop.set()
        self._wake_readers()
        self._reader.join(timeout=2.0)
        self._mark_dead(EngineDeadError("the engine client was shut down"))
        self.core.shutdown(self.shutdown_timeout_s)  # the watcher is stopped after this
        self.ctx.destroy(linger=0)
        self._close_wake_pipe()

    def _close_wake_pipe(self) -> None:
        with self._wake_lock:
            if self._wake_w >= 0:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_r = self._wake_w = -1
