"""The EngineCore busy loop: input queue in, EngineCore steps, output queue out.

No sockets here. `EngineCoreProc` feeds `input_queue` from its input thread; the loop hands
each step's outputs to `emit` (by default `output_queue.put_nowait`; `EngineCoreProc` sends
them at once on this thread when it can, else through its output thread). The loop itself
runs on the core process's main thread, which is the only thread that touches the
EngineCore.

Loop invariants:
- Idle (the core has no work): block on the input queue; no spinning.
- Busy: drain every waiting input (so ADDs that arrived during a step join one batch),
  then step once. Only non-empty EngineCoreOutputs go to the output queue.
- Every ADD gets an answer: tokens, or a finished ERROR output naming why (duplicate id,
  rejected by the scheduler, engine shutting down).
- Shutdown (`request_shutdown`, signal-safe): new ADDs are refused with an ERROR output,
  in-flight requests run to completion (or are failed once `drain_timeout_s` passes),
  then `run()` returns.
- An exception escaping `EngineCore.step()` escapes `run()`: the caller treats it as fatal.
"""

from __future__ import annotations

import enum
import logging
import queue
import time
from collections.abc import Callable
from typing import Any

import msgspec

from engine.core.engine_core import EngineCore
from engine.core.messages import UTILITY_METHODS, UtilityCall
from engine.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    UtilityOutput,
)

logger = logging.getLogger(__name__)

_EMPTY_STEP_S = 0.001  # a step faster than this that produced nothing ran no model
# While every request is parked for remote KV the loop blocks on its input queue: the
# connector's publish (KV landed or failed, blocks freed) puts a WAKEUP there, as do ADDs,
# aborts, utilities and shutdown. This backstop only bounds the scheduler-side timers that
# nothing else wakes (the connector's registration watchdog, minutes; the drain deadline):
# one step a second, where a 50 ms wait cost four parked legs ~1.6 % of a core.
_PARKED_BACKSTOP_S = 1.0


class InputKind(enum.Enum):
    ADD = "add"
    ABORT = "abort"
    UTILITY = "utility"
    WAKEUP = "wakeup"  # no payload: re-check the shutdown flag
    FATAL = "fatal"  # payload: why the engine cannot go on (a TP worker died)
    DP_CONTROL = "dp_control"  # a coordinator message (engine.dp.lockstep handles it)


class EngineCoreLoop:
    """Owns an EngineCore and drives it from queues. `run()` is the busy loop."""

    def __init__(
        self, core: EngineCore, engine_index: int = 0, drain_timeout_s: float = 60.0
    ) -> None:
        self.core = core
        self.engine_index = engine_index
        self.drain_timeout_s = drain_timeout_s
        # SimpleQueue: put() is reentrant, so a signal handler may call request_shutdown().
        self.input_queue: queue.SimpleQueue[tuple[InputKind, Any]] = queue.SimpleQueue()
        # Aborts also travel here so they reach the core before the next step, not only
        # in input order.
        self.aborts_queue: queue.SimpleQueue[list[str]] = queue.SimpleQueue()
        self.output_queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # Where EngineCoreOutputs go, in order (EngineCoreProc replaces it, see there).
        self.emit: Callable[[Any], None] = self.output_queue.put_nowait
        self.num_steps = 0
        self.step_started: float | None = None  # monotonic start of the step in progress
        self.num_malformed_inputs = 0  # bumped by the input thread (single writer)
        self._stopping = False
        self._drain_deadline: float | None = None
        # Called with the scheduler's stats before each step (the requests just admitted)
        # and after it (data parallel: the engine's counts to the coordinator).
        self.on_step: Callable[[Any], None] | None = None
        core.executor.on_failure = self.fail
        # A connector that wakes the loop when its transfers finish lets an idle wait
        # (requests parked for remote KV) sleep instead of stepping every millisecond.
        self._woken = core.executor.set_wakeup(self._wake)
        if core.executor.failure is not None:
            self.fail(core.executor.failure)

    def fail(self, reason: str) -> None:
        """Any thread (the TP executor's monitor): make `run()` raise now, also when idle, so
        the owner reports the engine dead at once (a step in flight raises by itself)."""
        self.input_queue.put_nowait((InputKind.FATAL, reason))

    # -- called from other threads / signal handlers ------------------------------------
    def _wake(self) -> None:
        self.input_queue.put_nowait((InputKind.WAKEUP, None))

    def request_shutdown(self) -> None:
        """Stop accepting requests; drain; then `run()` returns. Signal-handler safe."""
        self._stopping = True
        self.input_queue.put_nowait((InputKind.WAKEUP, None))

    @property
    def stopping(self) -> bool:
        return self._stopping

    # -- the loop (core thread) -----------------------------------------------------------
    def run(self) -> None:
        while True:
            if not self.core.has_work():
                if self._stopping:
                    logger.info("engine %d: drained, leaving the busy loop", self.engine_index)
                    return
                self._clear_aborts_queue()
                self._handle(*self.input_queue.get())
            self._drain_inputs()
            if self._stopping:
                self._enforce_drain_deadline()
            if self.core.has_work():
                self._step()

    def _drain_inputs(self) -> None:
        while True:
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                return
            self._handle(*item)

    def _step(self) -> None:
        self._apply_aborts_queue()
        if self.on_step is not None:
            self.on_step(self.core.scheduler.make_stats())
        started = time.perf_counter()
        self.step_started = time.monotonic()
        try:
            outputs = self.core.step()
        finally:
            self.step_started = None
        self.num_steps += 1
        if self.on_step is not None:
            self.on_step(outputs.scheduler_stats)
        if outputs.outputs or outputs.finished_requests:
            outputs.engine_index = self.engine_index
            self.emit(outputs)
        elif self._woken and self.core.scheduler.only_parked():
            # Every request waits for remote KV: the connector wakes the loop when it lands.
            self._handle_next(_PARKED_BACKSTOP_S)
        elif time.perf_counter() - started < _EMPTY_STEP_S:
            # Work exists but nothing could run (KV that just landed is scheduled next step):
            # give the connector / I/O threads the GIL instead of spinning.
            self._handle_next(_EMPTY_STEP_S)

    def _handle_next(self, timeout: float) -> None:
        """Handle the next input if one arrives within `timeout` seconds."""
        try:
            self._handle(*self.input_queue.get(timeout=timeout))
        except queue.Empty:
            pass

    def _handle(self, kind: InputKind, payload: Any) -> None:
        if kind is InputKind.ADD:
            self._add(payload)
        elif kind is InputKind.ABORT:
            self.core.abort_requests(payload)
        elif kind is InputKind.UTILITY:
            self._utility(payload)
        elif kind is InputKind.FATAL:
            raise RuntimeError(payload)
        # WAKEUP: nothing to do; the caller re-checks the shutdown flag.

    def _add(self, request: EngineCoreRequest) -> None:
        if self._stopping:
            self._reply_error(request.request_id, "engine is shutting down; request refused")
            return
        try:
            self.core.add_request(request)
        except Exception as e:  # a bad request is an answer, never a dead engine
            logger.warning("engine %d: request %s rejected: %s", self.engine_index,
                           request.request_id, e)
            self._reply_error(request.request_id, f"request rejected: {e}")

    def _utility(self, call: UtilityCall) -> None:
        out = UtilityOutput(call_id=call.call_id)
        if call.method not in UTILITY_METHODS:
            out.failure_message = f"unknown utility method {call.method!r}"
        else:
            try:
                result = getattr(self.core, call.method)(*call.args)
                if call.method == "get_stats":
                    result = {**result, **self.stats()}
                # Plain data only, so the output thread can always encode the reply.
                out.result = msgspec.to_builtins(result)
            except Exception as e:
                logger.warning("engine %d: utility %s (call %d) failed: %s",
                               self.engine_index, call.method, call.call_id, e)
                out.failure_message = f"{type(e).__name__}: {e}"
        self.emit(
            EngineCoreOutputs(engine_index=self.engine_index, utility_output=out,
                              timestamp=time.time())
        )

    def stats(self) -> dict[str, Any]:
        return {"num_steps": self.num_steps, "num_malformed_inputs": self.num_malformed_inputs,
                "stopping": self._stopping}

    def _reply_error(self, request_id: str, message: str) -> None:
        out = EngineCoreOutput(request_id=request_id, new_token_ids=[],
                               finish_reason=FinishReason.ERROR, error=message)
        self.emit(
            EngineCoreOutputs(engine_index=self.engine_index, outputs=[out],
                              timestamp=time.time())
        )

    def _apply_aborts_queue(self) -> None:
        ids: list[str] = []
        while True:
            try:
                ids.extend(self.aborts_queue.get_nowait())
            except queue.Empty:
                break
        if ids:
            self.core.abort_requests(ids)

    def _clear_aborts_queue(self) -> None:
        # Idle: every abort in this mirror already went (or is going) through input_queue.
        while True:
            try:
                self.aborts_queue.get_nowait()
            except queue.Empty:
                return

    def _enforce_drain_deadline(self) -> None:
        now = time.monotonic()
        if self._drain_deadline is None:
            self._drain_deadline = now + self.drain_timeout_s
            return
        if now < self._drain_deadline:
            return
        ids = list(self.core.scheduler.requests)
        if not ids:
            return
        logger.warning("engine %d: drain timeout (%.0fs); failing %d request(s)",
                       self.engine_index, self.drain_timeout_s, len(ids))
        self.core.abort_requests(ids)
        for rid in ids:
            self._reply_error(rid, "engine shut down before the request finished")
