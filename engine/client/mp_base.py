"""What the sync and async multiprocess clients share: the core process, encoding, decoding
of outputs (the ENGINE_CORE_DEAD sentinel and heartbeats included) and death bookkeeping.

Silence (engine/core/liveness.py): the core sends a heartbeat every interval, so a core the
client has heard nothing from for `config.heartbeat_timeout_s` — while its output socket holds
nothing unread — is stopped or frozen: `check_silence()` kills it (SIGKILL: it stays dead
after a SIGCONT) and returns the EngineDeadError naming why; the readers call it when their
wait for output runs out.

Readers block on the output socket with no timer of their own: the core's heartbeats (one
a second at most) wake them, the process watcher wakes them when the core exits
(`_wake_readers`), and their wait ends at the latest when the core would have been silent
past `heartbeat_timeout_s` (`reader_timeout_ms`). An idle frontend wakes once a heartbeat."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any

import msgspec
import zmq

from engine.client.base import EngineCoreClient, EngineDeadError
from engine.client.core_process import DEFAULT_STARTUP_TIMEOUT_S, CoreProcess
from engine.config import EngineConfig
from engine.core.messages import (
    ENGINE_CORE_DEAD,
    HEARTBEAT_SIZE,
    MAX_DEAD_REASON,
    decode_dead,
    decode_heartbeat,
)
from engine.protocol import EngineCoreOutputs, EngineCoreRequestType, UtilityOutput
from engine.serial import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger(__name__)

_MAX_SENTINEL = len(ENGINE_CORE_DEAD) + 1 + MAX_DEAD_REASON  # a longer frame is outputs


class UtilityCallError(RuntimeError):
    """A utility method raised inside the engine core."""


class MPClientBase(EngineCoreClient):
    """Process lifecycle, encoding, output dispatch and death bookkeeping shared by both."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        engine_index: int = 0,
        use_tcp: bool = False,
        host: str = "127.0.0.1",
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        utility_timeout_s: float = 60.0,
        shutdown_timeout_s: float = 5.0,
        coordinator: Any = None,
    ) -> None:
        self.config = config
        self.engine_index = engine_index
        self.utility_timeout_s = utility_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.ctx = zmq.Context()
        try:
            self.core = CoreProcess(config, self.ctx, engine_index=engine_index,
                                    use_tcp=use_tcp, host=host,
                                    startup_timeout_s=startup_timeout_s,
                                    coordinator=coordinator)
        except BaseException:
            self.ctx.destroy(linger=0)
            raise
        self.num_kv_blocks = self.core.ready.num_kv_blocks
        self.max_model_len = self.core.ready.max_model_len
        self.supported_tasks = list(self.core.ready.supported_tasks)
        self.encoder = MsgpackEncoder()
        self.decoder = MsgpackDecoder(EngineCoreOutputs)
        self.num_malformed_outputs = 0
        self._call_ids = itertools.count(1)
        self._dead: EngineDeadError | None = None
        self._exited = threading.Event()
        self._shut_down = False
        self.heartbeat_timeout_s = config.heartbeat_timeout_s
        self._last_heard = time.monotonic()
        self.last_step_age_s = 0.0  # from the last heartbeat: how long the step had run
        self.core.watch(self._on_core_exit)

    # -- shared helpers -------------------------------------------------------------------
    def _on_core_exit(self, code: int | None) -> None:
        """The process watcher's thread: the core exited unasked."""
        self._exited.set()
        self._wake_readers()

    def _wake_readers(self) -> None:
        """Any thread: make the reader look at the exit and stop flags now."""
        raise NotImplementedError

    def reader_timeout_ms(self) -> int:
        """How long a reader may block on the output socket: until the core has been silent
        for `heartbeat_timeout_s` (then `check_silence` decides)."""
        left = self._last_heard + self.heartbeat_timeout_s - time.monotonic()
        return max(1, int(left * 1000) + 1)

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    @property
    def dead_error(self) -> EngineDeadError | None:
        # The process watcher notices a silent death even before any reader has run. Not
        # stored here: the reader's _mark_dead must still run and wake the output waiters.
        if self._dead is None and self._exited.is_set():
            return EngineDeadError(self._exit_reason())
        return self._dead

    def _ensure_alive(self) -> None:
        if (error := self.dead_error) is not None:
            raise EngineDeadError(str(error))

    def _exit_reason(self) -> str:
        return (f"engine core {self.engine_index} (pid {self.core.pid}) exited with code "
                f"{self.core.exitcode}")

    def _frames(self, kind: EngineCoreRequestType, obj: Any) -> list[Any]:
        return [self.core.identity, kind.value, *self.encoder.encode(obj)]

    def _decode(self, frames: list[zmq.Frame]) -> EngineCoreOutputs | None:
        """Outputs, or None for a heartbeat or a malformed message (counted, logged,
        dropped). Any message proves the core alive.

        Raises EngineDeadError when the frames are the ENGINE_CORE_DEAD sentinel.
        """
        self._last_heard = time.monotonic()
        if len(frames) == 1 and frames[0].buffer.nbytes <= _MAX_SENTINEL:
            head = bytes(frames[0].buffer)
            if len(head) == HEARTBEAT_SIZE and (beat := decode_heartbeat(head)) is not None:
                self.last_step_age_s = beat[0]
                return None
            if (reason := decode_dead(head)) is not None:
                why = f": {reason}" if reason else ""
                raise EngineDeadError(f"engine core {self.engine_index} (pid {self.core.pid}) "
                                      f"hit a fatal error (ENGINE_CORE_DEAD){why}")
        try:
            return self.decoder.decode(frames)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.num_malformed_outputs += 1
            logger.warning("engine %d: dropped malformed output message: %s",
                           self.engine_index, e)
            return None

    def check_silence(self) -> EngineDeadError | None:
        """Reader only, after a poll found nothing unread: the error naming why the core is
        declared dead when it has been silent past the heartbeat timeout (it is killed)."""
        silent = time.monotonic() - self._last_heard
        if silent <= self.heartbeat_timeout_s or self._shut_down or self._exited.is_set():
            return None
        reason = (f"engine core {self.engine_index} (pid {self.core.pid}) is not responding: "
                  f"no heartbeat for {silent:.1f}s (heartbeat_timeout_s "
                  f"{self.heartbeat_timeout_s:g}; the process is stopped or frozen); it was "
                  "killed and its requests failed")
        logger.error("%s", reason)
        self.core.kill()
        return EngineDeadError(reason)

    @staticmethod
    def _utility_result(method: str, out: UtilityOutput) -> Any:
        if out.failure_message is not None:
            raise UtilityCallError(f"utility {method} failed in the engine core: "
                                   f"{out.failure_message}")
        return out.result
