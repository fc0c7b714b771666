"""Frontend side of one engine-core process: sockets, spawn, handshake, watch, teardown.

Socket topology (the frontend binds everything, the engine connects):
- input:     ROUTER (ROUTER_MANDATORY: a send to a gone engine raises instead of vanishing)
             ← DEALER in the engine, identity `engine_identity(engine_index)`;
- output:    PULL ← PUSH in the engine;
- handshake: ROUTER ← DEALER in the engine; closed once the engine is READY.
Addresses are `ipc://` files in a private temp dir (removed on shutdown) or `tcp://`.

Invariants:
- `CoreProcess(...)` returns only once the engine is READY and its input DEALER is known to
  the ROUTER (the registration frame arrived), so the first request can never be dropped.
  If the child dies or reports FAILED during startup, the constructor raises RuntimeError
  naming the cause and leaves no process or file behind.
- `watch(callback)` calls `callback(exitcode)` once, from the "EngineCoreMonitor_<i>" thread,
  as soon as the child exits for any reason other than `shutdown()`.
- `shutdown()` is idempotent: SIGTERM, wait, SIGKILL; closes the sockets; removes the IPC
  dir. A finalizer does the same if the owner is garbage-collected without calling it.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from engine.config import EngineConfig
from engine.core.messages import (
    HandshakeFailed,
    HandshakeHello,
    HandshakeInit,
    HandshakeReady,
    decode_handshake,
    encode_handshake,
    engine_identity,
)
from engine.startup import (
    EXIT_STARTUP_STALLED,
    StartupStalled,
    config_to_dict,
    stage_deadline,
)

logger = logging.getLogger(__name__)

_SLOW_STAGE_S = 20.0  # a slower start-up stage is logged (where the time went)
DEFAULT_STARTUP_TIMEOUT_S: float | None = None  # None: the start-up stages' deadlines only
MAIN_GUARD_HINT = ("the engine core runs in a spawned process, which imports your main script "
                   "again: put the code that creates the engine (LLM(...), AsyncLLM(...)) under "
                   "`if __name__ == \"__main__\":`, or pass multiprocess=False")



def _run_core(**kwargs: Any) -> None:
    """The spawned core process's entry. The engine core and its busy loops (torch, the model)
    are imported here, in the child, so the API server that spawns it never imports torch."""
    from engine.core.engine_core_proc import run_engine_core
    from engine.dp.loops import build_loop

    run_engine_core(**kwargs, build_loop=build_loop)

class UnguardedMainError(RuntimeError):
    """An engine was created while a spawned process was importing the user's main script."""


def refuse_inside_spawn_import() -> None:
    """Raise UnguardedMainError when called from a spawned child that is still importing its
    parent's main module (multiprocessing marks that phase `_inheriting`): the script creates
    an engine at import time, so every child would try to start another."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise UnguardedMainError(
            f"pdserve: an engine was created at import time; {MAIN_GUARD_HINT}")


def _main_is_a_script() -> bool:
    import sys

    return bool(getattr(sys.modules.get("__main__"), "__file__", None))


def exit_code(proc: multiprocessing.process.BaseProcess, grace_s: float = 1.0) -> int | None:
    """The child's exit code, None while it runs.

    Two threads may join a child at once (the monitor and the owner). Only one of them reaps
    it; the other's waitpid fails, and multiprocessing reports None to it until the reaper has
    stored the code. So a child whose sentinel says it has ended is waited for, briefly.
    """
    code = proc.exitcode
    if code is None and multiprocessing.connection.wait([proc.sentinel], 0):
        deadline = time.monotonic() + grace_s
        while code is None and time.monotonic() < deadline:
            time.sleep(0.005)
            code = proc.exitcode
    return code


def _terminate(proc: multiprocessing.process.BaseProcess, timeout_s: float) -> None:
    if proc.pid is None or proc.exitcode is not None:
        return
    proc.terminate()
    proc.join(timeout_s)
    if proc.exitcode is None:
        logger.warning("engine core pid %d ignored SIGTERM for %.1fs; killing it",
                       proc.pid, timeout_s)
        proc.kill()
        proc.join(5.0)


def _cleanup(proc: multiprocessing.process.BaseProcess, ipc_dir: str | None) -> None:
    _terminate(proc, 2.0)
    if ipc_dir:
        shutil.rmtree(ipc_dir, ignore_errors=True)


class CoreProcess:
    """One spawned EngineCoreProc and the frontend's sockets to it."""

    def __init__(
        self,
        config: EngineConfig,
        ctx: zmq.Context,
        *,
        engine_index: int = 0,
        use_tcp: bool = False,
        host: str = "127.0.0.1",
        startup_timeout_s: float | None = DEFAULT_STARTUP_TIMEOUT_S,
        coordinator: Any = None,
    ) -> None:
        """`coordinator`: the DP coordinator's addresses (engine.dp.coordinator), or None.
        Start-up runs as stages with deadlines (engine/core/startup.py): engine_core_spawn
        (until HELLO), engine_core_start (until READY; the core's own stages end it sooner),
        engine_core_registration; `startup_timeout_s`, when given, caps the whole."""
        self._stage_override = config.startup_stage_timeout_s
        refuse_inside_spawn_import()
        self._coordinator = coordinator
        self.engine_index = engine_index
        self.identity = engine_identity(engine_index)
        self._ipc_dir = None if use_tcp else tempfile.mkdtemp(prefix="pdserve-")
        self._closed = False
        self._monitor_stop_r, self._monitor_stop_w = os.pipe()
        self._monitor: threading.Thread | None = None
        sockets: list[zmq.Socket] = []
        try:
            self.input_socket = self._bind(ctx, zmq.ROUTER, "input", host, sockets)
            self.input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self.output_socket = self._bind(ctx, zmq.PULL, "output", host, sockets)
            handshake = self._bind(ctx, zmq.ROUTER, "handshake", host, sockets)
            mp_ctx = multiprocessing.get_context("spawn")
            self.proc = mp_ctx.Process(
                target=_run_core,
                kwargs={
                    "config": config_to_dict(config),
                    "engine_index": engine_index,
                    "handshake_address": handshake.getsockopt_string(zmq.LAST_ENDPOINT),
                    "parent_pid": os.getpid(),
                    "log_level": logging.getLogger().getEffectiveLevel(),
                },
                name=f"EngineCore_{engine_index}",
                daemon=True,
            )
            self.proc.start()
            self._finalizer = weakref.finalize(self, _cleanup, self.proc, self._ipc_dir)
            self.ready = self._handshake(handshake, startup_timeout_s)
            self._await_registration()
        except BaseException:
            for sock in sockets:
                sock.close(linger=0)
            proc = getattr(self, "proc", None)
            if proc is not None:
                _cleanup(proc, self._ipc_dir)
            elif self._ipc_dir:
                shutil.rmtree(self._ipc_dir, ignore_errors=True)
            os.close(self._monitor_stop_r)
            os.close(self._monitor_stop_w)
            raise
        handshake.close(linger=0)
        logger.info("engine %d ready: pid %d, %d KV blocks, max_model_len %d",
                    engine_index, self.proc.pid, self.ready.num_kv_blocks,
                    self.ready.max_model_len)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def exitcode(self) -> int | None:
        return exit_code(self.proc)

    def _bind(self, ctx: zmq.Context, kind: int, name: str, host: str,
              sockets: list[zmq.Socket]) -> zmq.Socket:
        sock = ctx.socket(kind)
        sockets.append(sock)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.PULL or kind == zmq.ROUTER:
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
        if self._ipc_dir is not None:
            sock.bind(f"ipc://{self._ipc_dir}/{name}.ipc")
        else:
            sock.bind(f"tcp://{host}:*")
        return sock

    def _deadline(self, stage: str, cap: float | None) -> tuple[str, float, float]:
        """(stage, when it must be over, its seconds)."""
        seconds = stage_deadline(stage, self._stage_override)
        deadline = time.monotonic() + seconds
        return stage, deadline if cap is None else min(deadline, cap), seconds

    def _wait_readable(self, sock: zmq.Socket, stage: tuple[str, float, float],
                       what: str) -> None:
        """Poll `sock`; fail fast when the child exits, and at the stage's deadline."""
        name, deadline, seconds = stage
        while not sock.poll(timeout=100):
            code = self.proc.exitcode
            if code is not None:
                hint = (f" (its error is above; if it is UnguardedMainError: {MAIN_GUARD_HINT})"
                        if _main_is_a_script() else "")
                if code == EXIT_STARTUP_STALLED:
                    hint = " (a start-up stage of the engine core stalled: see its log above)"
                raise RuntimeError(f"engine core {self.engine_index} (pid {self.proc.pid}) "
                                   f"exited with code {code} while {what}{hint}")
            if time.monotonic() > deadline:
                raise StartupStalled(f"engine core {self.engine_index} (pid {self.proc.pid})",
                                     name, seconds)

    def _log_if_slow(self, stage: tuple[str, float, float]) -> None:
        name, deadline, seconds = stage
        took = seconds - (deadline - time.monotonic())
        if took > _SLOW_STAGE_S:
            logger.warning("engine core %d (pid %d): start-up stage %r took %.1fs (deadline "
                           "%.0fs)", self.engine_index, self.proc.pid, name, took, seconds)

    def _handshake(self, sock: zmq.Socket, timeout_s: float | None) -> HandshakeReady:
        cap = None if timeout_s is None else time.monotonic() + timeout_s
        stage = self._deadline("engine_core_spawn", cap)
        init = HandshakeInit(
            input_address=self.input_socket.getsockopt_string(zmq.LAST_ENDPOINT),
            output_address=self.output_socket.getsockopt_string(zmq.LAST_ENDPOINT),
        )
        if self._coordinator is not None:
            init.coordinator_engine_in = self._coordinator.engine_in
            init.coordinator_wave_pub = self._coordinator.wave_pub
        while True:
            self._wait_readable(sock, stage, "waiting for the handshake")
            frames = sock.recv_multipart()
            if len(frames) != 2 or frames[0] != self.identity:
                logger.warning("handshake: dropped a message from unexpected peer %r",
                               frames[0] if frames else None)
                continue
            try:
                msg = decode_handshake(frames[1])
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                logger.warning("handshake: dropped a malformed message from engine %d: %s",
                               self.engine_index, e)
                continue
            if isinstance(msg, HandshakeHello):
                sock.send_multipart([self.identity, encode_handshake(init)])
                self._log_if_slow(stage)
                stage = self._deadline("engine_core_start", cap)
            elif isinstance(msg, HandshakeReady):
                self._log_if_slow(stage)
                return msg
            elif isinstance(msg, HandshakeFailed):
                raise RuntimeError(f"engine core {self.engine_index} failed to start: "
                                   f"{msg.error}")
            else:
                raise RuntimeError(f"engine core {self.engine_index}: unexpected handshake "
                                   f"message {msg!r}")

    def _await_registration(self) -> None:
        self._wait_readable(self.input_socket, self._deadline("engine_core_registration", None),
                            "waiting for the input registration")
        frames = self.input_socket.recv_multipart()
        if frames[0] != self.identity:
            raise RuntimeError(f"input registration from unexpected peer {frames[0]!r}")

    def kill(self) -> None:
        """SIGKILL the core (also when it is stopped): a core declared hung stays dead. Its
        exit then reaches `watch` like any other; TP workers follow their parent."""
        if self.proc.exitcode is None:
            logger.error("engine core %d (pid %d): killing it", self.engine_index, self.proc.pid)
            self.proc.kill()

    def watch(self, on_exit: Callable[[int | None], Any]) -> None:
        """Call `on_exit(exitcode)` from a monitor thread when the child exits unasked."""

        def monitor() -> None:
            ready = multiprocessing.connection.wait([self.proc.sentinel, self._monitor_stop_r])
            if self.proc.sentinel in ready and not self._closed:
                self.proc.join(1.0)
                code = self.exitcode
                logger.error("engine core %d (pid %d) exited with code %s",
                             self.engine_index, self.proc.pid, code)
                on_exit(code)

        self._monitor = threading.Thread(target=monitor, daemon=True,
                                         name=f"EngineCoreMonitor_{self.engine_index}")
        self._monitor.start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Terminate the child (drain up to `timeout_s`), close sockets, remove IPC files."""
        if self._closed:
            return
        self._closed = True
        os.write(self._monitor_stop_w, b"x")
        if self._monitor is not None:
            self._monitor.join(2.0)
        _terminate(self.proc, timeout_s)
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self._finalizer.detach()
        if self._ipc_dir:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
        os.close(self._monitor_stop_r)
        os.close(self._monitor_stop_w)
