"""The engine side of the data-parallel coordinator.

`CoordinatorLink`: a PUSH socket to the coordinator, used only by the busy-loop thread
(stats after steps that change the engine's counts; StartWave), and — for lockstep engines —
a SUB thread "DPWaveListener_<rank>" that hands StartDPWave / WaveComplete to the busy loop
through its input queue (so an idle engine wakes up). Sends never block: with the
coordinator gone, messages are dropped and the engine keeps serving.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import zmq

from engine.core.busy_loop import EngineCoreLoop, InputKind
from engine.core.messages import HandshakeInit
from engine.dp.messages import (
    DECODE_ERRORS,
    ENCODER,
    EngineStats,
    StartWave,
    wave_msg_decoder,
)

logger = logging.getLogger(__name__)


class CoordinatorLink:
    def __init__(self, ctx: zmq.Context, rank: int, init: HandshakeInit) -> None:
        self.rank = rank
        self.push = ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.setsockopt(zmq.SNDHWM, 1000)
        self.push.connect(init.coordinator_engine_in)
        self.wave = 0  # the wave the engine is in (the lockstep loop keeps it)
        self._last: tuple[int, int] | None = None
        self.num_malformed = 0

    def stats(self, stats: Any) -> None:
        """Busy-loop hook after a step: publish the counts when they changed."""
        if stats is None:
            return
        counts = (int(stats.num_waiting_reqs), int(stats.num_running_reqs))
        if counts != self._last:
            self._last = counts
            self._send(EngineStats(self.rank, *counts, wave=self.wave))

    def force_next_stats(self) -> None:
        self._last = None

    def start_wave(self, wave: int) -> None:
        self._send(StartWave(self.rank, wave))

    def _send(self, msg: Any) -> None:
        try:
            self.push.send(ENCODER.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the coordinator is gone or far behind: stats are best effort

    def listen_for_waves(self, ctx: zmq.Context, address: str, loop: EngineCoreLoop,
                         stop: threading.Event) -> None:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(address)
        threading.Thread(target=self._listen, args=(sub, loop, stop), daemon=True,
                         name=f"DPWaveListener_{self.rank}").start()

    def _listen(self, sub: zmq.Socket, loop: EngineCoreLoop, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                if not sub.poll(timeout=200):
                    continue
                try:
                    msg = wave_msg_decoder.decode(sub.recv())
                except DECODE_ERRORS as e:
                    self.num_malformed += 1
                    logger.warning("engine %d: dropped a malformed coordinator message: %s",
                                   self.rank, e)
                    continue
                loop.input_queue.put_nowait((InputKind.DP_CONTROL, msg))
        except zmq.ZMQError:
            pass  # context destroyed at shutdown
        finally:
            sub.close(linger=0)
