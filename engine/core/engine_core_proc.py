"""EngineCoreProc: an EngineCore in its own process, talking ZeroMQ + msgpack.

Threads of the core process:
- main thread ("EngineCore_<i>"): the busy loop (`EngineCoreLoop.run`), the only thread that
  touches the EngineCore;
- "EngineCoreInput_<i>": DEALER (2-byte identity) connected to the client's ROUTER; decodes
  with one typed decoder per request type and puts work on the input queue. A malformed
  message is counted, logged (one line) and dropped; it never stops the thread;
- "EngineCoreOutput_<i>": PUSH connected to the client's PULL; sends heartbeats, DEAD and
  the outputs the busy loop could not send at once (engine/core/output_sender.py: the loop
  sends a step's outputs itself when the socket is free; both encode into reused bytearrays
  and send zero-copy, tracking each send until zmq is done with it);
- "EngineCoreParentWatch_<i>": exits the process when the parent process is gone, so no
  orphan engine outlives its frontend;
- "EngineCoreHeartbeat_<i>": the frontend's proof that this process lives, and the backstop
  for a step that never returns (engine/core/liveness.py);
- "StartupWatch": until READY, ends the process when a start-up stage overruns its deadline
  (engine/core/startup.py).

Exit codes: 0 after a clean shutdown (SIGTERM / SIGINT: refuse new requests, drain, exit),
1 after a fatal error (ENGINE_CORE_DEAD was sent first, with why), 3 when the parent died,
4 when a start-up stage stalled past its deadline (EXIT_STARTUP_STALLED).
The child is started with the multiprocessing *spawn* context; the config crosses as a
plain dict (see `config_to_dict`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from engine import stackdump
from engine.config import EngineConfig
from engine.core.busy_loop import EngineCoreLoop, InputKind
from engine.core.engine_core import EngineCore
from engine.core.liveness import CoreHeartbeat
from engine.core.messages import (
    HANDSHAKE_TIMEOUT_S,
    HandshakeFailed,
    HandshakeHello,
    HandshakeInit,
    HandshakeReady,
    UtilityCall,
    decode_handshake,
    encode_dead,
    encode_handshake,
    engine_identity,
)
from engine.core.output_sender import OutputSender
from engine.protocol import EngineCoreRequest, EngineCoreRequestType
from engine.serial import MsgpackDecoder
from engine.startup import StartupWatch

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_FATAL, EXIT_PARENT_DIED = 0, 1, 3
_PARENT_POLL_S = 0.5
_OUTPUT_LINGER_MS = 4000
_DEAD = object()  # output-queue marker: send ENGINE_CORE_DEAD and stop
_STOP = object()  # output-queue marker: flush and stop


LoopBuilder = Callable[[EngineCore, int, EngineConfig, zmq.Context, HandshakeInit,
                        threading.Event], EngineCoreLoop]


def plain_loop(core: EngineCore, engine_index: int, config: EngineConfig, ctx: zmq.Context,
               init: HandshakeInit, stop: threading.Event) -> EngineCoreLoop:
    """The busy loop of an engine without a data-parallel coordinator."""
    return EngineCoreLoop(core, engine_index)


class EngineCoreProc:
    """Handshake, I/O threads and busy loop of one engine-core process. The loop comes from
    `build_loop`: the process that spawns the core picks it (engine/dp/loops.py with data
    parallel), so the core never imports the layers above it."""

    def __init__(self, config: EngineConfig, engine_index: int, handshake_address: str,
                 watch: StartupWatch | None = None, build_loop: LoopBuilder = plain_loop
                 ) -> None:
        self.engine_index = engine_index
        self.identity = engine_identity(engine_index)
        self.ctx = zmq.Context()
        self._threads_stop = threading.Event()
        self._dead_sent = False
        self._dead_reason = ""
        watch = watch or StartupWatch(f"engine core {engine_index}",
                                      config.startup_stage_timeout_s)
        hs = self.ctx.socket(zmq.DEALER)
        hs.setsockopt(zmq.IDENTITY, self.identity)
        hs.setsockopt(zmq.LINGER, _OUTPUT_LINGER_MS)
        hs.connect(handshake_address)
        try:
            init = self._hello(hs)
            try:
                core = EngineCore(config, watch)
            except Exception as e:
                hs.send(encode_handshake(HandshakeFailed(error=f"{type(e).__name__}: {e}")))
                raise
            self.loop = build_loop(core, engine_index, config, self.ctx, init,
                                   self._threads_stop)
            self.sender = OutputSender()
            self.loop.emit = self._emit
            with watch.stage("io_threads"):
                self._start_io_threads(init)
            with watch.stage("ready"):
                max_model_len = (getattr(core, "max_model_len", None)
                                 or core.runner.max_model_len)
                hs.send(encode_handshake(HandshakeReady(
                    num_kv_blocks=core.num_kv_blocks, max_model_len=int(max_model_len),
                    supported_tasks=list(core.get_supported_tasks()),
                )))
        finally:
            watch.close()
            hs.close()
        self.heartbeat = CoreHeartbeat(
            self.loop, engine_index, config.heartbeat_timeout_s,
            config.step_timeout_s + config.heartbeat_timeout_s, self._die_stuck,
            self._threads_stop)
        self.heartbeat.start()

    def _hello(self, hs: zmq.Socket) -> HandshakeInit:
        hs.send(encode_handshake(HandshakeHello(engine_index=self.engine_index, pid=os.getpid())))
        if not hs.poll(timeout=int(HANDSHAKE_TIMEOUT_S * 1000)):
            raise RuntimeError(f"engine {self.engine_index}: no handshake reply from the "
                               f"frontend within {HANDSHAKE_TIMEOUT_S:.0f}s")
        msg = decode_handshake(hs.recv())
        if not isinstance(msg, HandshakeInit):
            raise RuntimeError(f"engine {self.engine_index}: expected INIT, got {msg!r}")
        return msg

    def _start_io_threads(self, init: HandshakeInit) -> None:
        ready = threading.Event()
        self.input_thread = threading.Thread(
            target=self._input_thread, args=(init.input_address, ready),
            name=f"EngineCoreInput_{self.engine_index}", daemon=True)
        self.output_thread = threading.Thread(
            target=self._output_thread, args=(init.output_address,),
            name=f"EngineCoreOutput_{self.engine_index}", daemon=True)
        self.input_thread.start()
        self.output_thread.start()
        while not ready.wait(timeout=1.0):
            if not self.input_thread.is_alive():
                raise RuntimeError("input thread died during startup")

    # -- input thread -----------------------------------------------------------------
    def _input_thread(self, address: str, ready: threading.Event) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        sock.send(b"")  # registration: lets the client's ROUTER route to us from now on
        ready.set()
        decoders = {
            EngineCoreRequestType.ADD: MsgpackDecoder(EngineCoreRequest),
            EngineCoreRequestType.ABORT: MsgpackDecoder(list[str]),
            EngineCoreRequestType.UTILITY: MsgpackDecoder(UtilityCall),
        }
        try:
            while not self._threads_stop.is_set():
                if not sock.poll(timeout=200):
                    continue
                frames = sock.recv_multipart(copy=False)
                try:
                    kind = EngineCoreRequestType(bytes(frames[0].buffer))
                    payload = decoders[kind].decode(frames[1:])
                except Exception as e:
                    self.loop.num_malformed_inputs += 1
                    logger.warning("engine %d: dropped malformed input message (%d frames): "
                                   "%s: %s", self.engine_index, len(frames),
                                   type(e).__name__, e)
                    continue
                self._enqueue(kind, payload)
        finally:
            sock.close()

    def _enqueue(self, kind: EngineCoreRequestType, payload: Any) -> None:
        if kind is EngineCoreRequestType.ADD:
            self.loop.input_queue.put_nowait((InputKind.ADD, payload))
        elif kind is EngineCoreRequestType.ABORT:
            self.loop.aborts_queue.put_nowait(payload)
            self.loop.input_queue.put_nowait((InputKind.ABORT, payload))
        else:
            self.loop.input_queue.put_nowait((InputKind.UTILITY, payload))

    # -- output thread ----------------------------------------------------------------
    def _emit(self, outputs: Any) -> None:
        """The busy loop's outputs: sent at once when the socket is free (output_sender.py),
        else queued for the output thread, in order. After sending, the loop yields its CPU
        once: the API server that forwards these tokens (and zmq's I/O thread) run before
        the next step instead of after the scheduler's slice (a no-op on an idle CPU)."""
        if self.sender.try_now(outputs):
            os.sched_yield()
            return
        with self.sender.lock:
            self.sender.queued += 1
        self.loop.output_queue.put_nowait(outputs)

    def _output_thread(self, address: str) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, _OUTPUT_LINGER_MS)
        sock.connect(address)
        out = self.sender
        with out.lock:
            out.sock = sock
        try:
            while True:
                item = self.loop.output_queue.get()
                with out.lock:
                    if item is _DEAD:
                        sock.send(encode_dead(self._dead_reason))
                        return
                    if item is _STOP:
                        return
                    if isinstance(item, bytes):  # a heartbeat, encoded by its thread
                        sock.send(item, copy=True)
                        continue
                    out.send(item)
                    out.queued -= 1
        except Exception:
            # Cannot talk to the client any more: that is fatal for the engine.
            logger.exception("engine %d: output thread failed", self.engine_index)
            self._dead_sent = True
            try:
                sock.send(encode_dead("the engine core's output thread failed"), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            os._exit(EXIT_FATAL)
        finally:
            with out.lock:
                out.sock = None
            sock.close()

    # -- lifecycle (main thread) --------------------------------------------------------
    def run(self) -> None:
        self.loop.run()

    def send_engine_dead(self, reason: str = "") -> None:
        if not self._dead_sent:
            self._dead_sent = True
            self._dead_reason = reason
            self.loop.output_queue.put_nowait(_DEAD)

    def _die_stuck(self, reason: str) -> None:
        """Heartbeat thread: a step never returned. Tell the frontend why, then end the
        process (the main thread cannot be interrupted; TP workers follow their parent)."""
        logger.error("%s; exiting with code %d", reason, EXIT_FATAL)
        self.send_engine_dead(reason)
        self.output_thread.join(timeout=2.0)
        sys.stderr.flush()
        os._exit(EXIT_FATAL)

    def close(self) -> None:
        """Flush outputs, stop the I/O threads, shut the core down. Main thread only."""
        if not self._dead_sent:
            self.loop.output_queue.put_nowait(_STOP)
        self.output_thread.join(timeout=_OUTPUT_LINGER_MS / 1000 + 1)
        self._threads_stop.set()
        self.input_thread.join(timeout=2)
        try:
            self.loop.core.shutdown()
        finally:
            self.ctx.destroy(linger=_OUTPUT_LINGER_MS)


def _watch_parent(parent_pid: int, engine_index: int) -> None:
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent_pid:
            logger.error("engine %d: parent process %d is gone; exiting", engine_index,
                         parent_pid)
            os._exit(EXIT_PARENT_DIED)


def _setup_logging(level: int, engine_index: int) -> None:
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(
            level=level, stream=sys.stderr,
            format=f"%(asctime)s %(levelname)s [EngineCore_{engine_index} pid=%(process)d] "
                   "%(name)s: %(message)s")
    root.setLevel(level)


def run_engine_core(config: dict[str, Any], engine_index: int, handshake_address: str,
                    parent_pid: int, log_level: int = logging.INFO,
                    build_loop: LoopBuilder = plain_loop) -> None:
    """Entry point of the spawned core process. Never returns; exits with a code above."""
    _setup_logging(log_level, engine_index)
    stackdump.install()
    threading.current_thread().name = f"EngineCore_{engine_index}"
    threading.Thread(target=_watch_parent, args=(parent_pid, engine_index),
                     name=f"EngineCoreParentWatch_{engine_index}", daemon=True).start()
    proc: EngineCoreProc | None = None
    code = EXIT_OK
    try:
        cfg = EngineConfig(**config)
        watch = StartupWatch(f"engine core {engine_index}", cfg.startup_stage_timeout_s)
        proc = EngineCoreProc(cfg, engine_index, handshake_address, watch, build_loop)
        loop = proc.loop

        def on_signal(signum: int, frame: Any) -> None:
            logger.info("engine %d: %s received; draining", engine_index,
                        signal.Signals(signum).name)
            loop.request_shutdown()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        proc.run()
    except (Exception, KeyboardInterrupt) as e:
        code = EXIT_FATAL
        if proc is None:
            logger.exception("engine %d failed to start: %s", engine_index, e)
        else:
            logger.exception("engine %d: fatal error in the busy loop: %s", engine_index, e)
            proc.send_engine_dead(f"{type(e).__name__}: {e}")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if proc is not None:
            try:
                proc.close()
            except Exception:
                logger.exception("engine %d: error during shutdown", engine_index)
                code = code or EXIT_FATAL
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is closed explicitly above; skip interpreter teardown (seconds with torch
    # loaded) so a shutdown is not mistaken for a hang and SIGKILLed.
    os._exit(code)
