"""The data-parallel coordinator: its own process between the engines and the frontend.

Sockets (bound here, at the explicit addresses the frontend chose; see `CoordinatorProcess`):
- `engine_in`  PULL  ← every engine PUSHes EngineStats (after steps that change its counts)
                       and StartWave (it got a request while no wave ran);
- `wave_pub`   PUB   → engines: StartDPWave, WaveComplete (lockstep mode only);
- `front_pub`  PUB   → the frontend: FrontStats every `interval_s`, and at once when a wave
                       starts or ends.
Malformed messages are counted and dropped. The process exits when its parent is gone.

Wave protocol (lockstep: engines whose forward passes are collective must step together):
a wave is a period in which every engine steps, idle ones running dummy steps. An engine that
gets a request while no wave runs sends StartWave; the coordinator marks it busy and
broadcasts StartDPWave(wave). Each engine's stats say whether it still has requests; once
every engine is idle the coordinator broadcasts WaveComplete(wave) and the wave number
moves on (seed 000: the count of running → paused transitions).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from dataclasses import dataclass

import zmq

from engine.dp.messages import (
    DECODE_ERRORS,
    ENCODER,
    EngineStats,
    FrontStats,
    StartDPWave,
    WaveComplete,
    engine_msg_decoder,
)

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 0.1
_PARENT_POLL_S = 0.5


@dataclass(frozen=True)
class CoordinatorAddresses:
    engine_in: str
    wave_pub: str
    front_pub: str


class Coordinator:
    """The coordinator's state and loop (runs in the coordinator process)."""

    def __init__(self, num_engines: int, lockstep: bool, interval_s: float) -> None:
        self.counts = [[0, 0] for _ in range(num_engines)]
        self.stamps = [0] * num_engines
        self.busy = [False] * num_engines
        self.lockstep = lockstep
        self.interval_s = interval_s
        self.wave = 0
        self.running = False
        self.seq = 0
        self.num_malformed = 0

    def on_engine_message(self, data: bytes) -> list[StartDPWave | WaveComplete]:
        """Apply one engine message; the wave messages to broadcast, in order."""
        try:
            msg = engine_msg_decoder.decode(data)
            if not 0 <= msg.rank < len(self.counts):
                raise ValueError(f"rank {msg.rank} out of range")
        except (*DECODE_ERRORS, ValueError) as e:
            self.num_malformed += 1
            logger.warning("coordinator: dropped a malformed engine message: %s", e)
            return []
        if isinstance(msg, EngineStats):
            self.counts[msg.rank] = [msg.waiting, msg.running]
            self.stamps[msg.rank] += 1
            self.busy[msg.rank] = msg.waiting + msg.running > 0
            return self._maybe_complete()
        if not self.lockstep:
            return []
        self.busy[msg.rank] = True
        if self.running:
            return []  # the wave already runs; the engine joined it when it sent this
        self.wave, self.running = max(self.wave, msg.wave), True
        return [StartDPWave(self.wave)]

    def _maybe_complete(self) -> list[StartDPWave | WaveComplete]:
        if not (self.lockstep and self.running) or any(self.busy):
            return []
        done = WaveComplete(self.wave)
        self.wave, self.running = self.wave + 1, False
        return [done]

    def front_stats(self) -> bytes:
        self.seq += 1
        return ENCODER.encode(FrontStats(self.seq, [list(c) for c in self.counts], self.wave,
                                         self.running, list(self.stamps)))

    def serve(self, engine_in: zmq.Socket, wave_pub: zmq.Socket, front_pub: zmq.Socket) -> None:
        parent = os.getppid()
        next_publish = time.monotonic()
        next_parent_check = next_publish + _PARENT_POLL_S
        while True:
            now = time.monotonic()
            if engine_in.poll(timeout=max(0, int((next_publish - now) * 1000))):
                while engine_in.poll(timeout=0):
                    out = self.on_engine_message(engine_in.recv())
                    for msg in out:
                        wave_pub.send(ENCODER.encode(msg))
                    if out:
                        front_pub.send(self.front_stats())
                continue
            front_pub.send(self.front_stats())
            next_publish = time.monotonic() + self.interval_s
            if next_publish > next_parent_check:
                if os.getppid() != parent:
                    logger.error("coordinator: parent process is gone; exiting")
                    return
                next_parent_check = next_publish + _PARENT_POLL_S


def run_coordinator(num_engines: int, lockstep: bool, interval_s: float,
                    addresses: CoordinatorAddresses, ready: multiprocessing.Event) -> None:
    """Entry point of the coordinator process."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s [DPCoordinator] %(message)s")
    ctx = zmq.Context()
    sockets = {name: ctx.socket(kind) for name, kind in
               (("engine_in", zmq.PULL), ("wave_pub", zmq.PUB), ("front_pub", zmq.PUB))}
    for name, sock in sockets.items():
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(getattr(addresses, name))
    ready.set()
    try:
        Coordinator(num_engines, lockstep, interval_s).serve(**sockets)
    finally:
        ctx.destroy(linger=0)
        os._exit(0)


class CoordinatorProcess:
    """Frontend handle: starts the coordinator, knows its addresses, stops it."""

    def __init__(self, num_engines: int, *, lockstep: bool = False,
                 interval_s: float = DEFAULT_INTERVAL_S, startup_timeout_s: float = 30.0
                 ) -> None:
        self._dir = tempfile.mkdtemp(prefix="pdserve-dp-")
        self.addresses = CoordinatorAddresses(
            *(f"ipc://{self._dir}/{name}.ipc" for name in ("engine_in", "wave_pub",
                                                           "front_pub")))
        mp = multiprocessing.get_context("spawn")
        ready = mp.Event()
        self.proc = mp.Process(target=run_coordinator, name="DPCoordinator", daemon=True,
                               args=(num_engines, lockstep, interval_s, self.addresses, ready))
        self.proc.start()
        deadline = time.monotonic() + startup_timeout_s
        while not ready.wait(0.1):
            if self.proc.exitcode is not None or time.monotonic() > deadline:
                self.shutdown()
                raise RuntimeError(f"the data-parallel coordinator did not start (exit code "
                                   f"{self.proc.exitcode})")
        logger.info("data-parallel coordinator pid %d for %d engines (lockstep=%s)",
                    self.proc.pid, num_engines, lockstep)

    @property
    def alive(self) -> bool:
        return self.proc.exitcode is None

    def shutdown(self) -> None:
        if self.proc.exitcode is None:
            self.proc.kill()
            self.proc.join(5.0)
        shutil.rmtree(self._dir, ignore_errors=True)
