"""The core process's output socket, shared by the busy loop and the output thread.

Why the loop sends outputs itself: handing a step's outputs to another thread of the same
process costs that thread a wake-up, a CPU and the GIL, and on a core the loop keeps busy (an
engine pinned to its core, or cores shared with another engine) the next step holds all three
until the scheduler's slice ends: per-stage timestamps on a 2-core EPYC (P and D pinned to a
core each) showed the output thread sending a colocated request's token 1 1-3 ms after the
step produced it, and D's tokens 4-7 ms after. The loop encodes and sends at once when the
socket is free and nothing older waits in the queue (outputs keep their order); otherwise (the
output thread is sending, older outputs are queued, or the PUSH socket is at its high-water
mark) the outputs go to the output thread's queue as before, so the loop never blocks on the
socket. The same holds one process further: with the API server on the loop's core, it
formatted token 1 2-3 ms late until the loop yielded its CPU once after sending
(`EngineCoreProc._emit`). Heartbeats, ENGINE_CORE_DEAD and the final flush stay on the
output thread.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import zmq

from engine.serial import MsgpackEncoder


class OutputSender:
    """Frames and sends EngineCoreOutputs zero-copy, reusing each buffer once zmq is done with
    it. Every use of `sock` holds `lock` (a zmq socket is not thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sock: zmq.Socket | None = None  # set by the output thread once connected
        self.queued = 0  # EngineCoreOutputs put on the output queue and not sent yet
        self._encoder = MsgpackEncoder()
        self._free: list[bytearray] = []
        # (trackers, body buffer, frames): frames keep tensor memory alive until sent.
        self._pending: deque[tuple[list[zmq.MessageTracker], bytearray, list[Any]]] = deque()

    def send(self, item: Any, flags: int = 0) -> None:
        """Send one EngineCoreOutputs (the caller holds `lock`). With zmq.NOBLOCK, raises
        zmq.Again when the socket is at its high-water mark (nothing was sent)."""
        assert self.sock is not None
        while self._pending and all(t.done for t in self._pending[0][0]):
            self._free.append(self._pending.popleft()[1])
        buf = self._free.pop() if self._free else bytearray()
        frames = self._encoder.encode_into(item, buf)
        trackers = []
        last = len(frames) - 1
        try:
            for i, frame in enumerate(frames):
                more = zmq.SNDMORE if i < last else 0
                trackers.append(self.sock.send(frame, more | (flags if i == 0 else 0),
                                               copy=False, track=True))
        except zmq.Again:
            self._free.append(buf)  # refused before its first frame: nothing went out
            raise
        self._pending.append((trackers, buf, frames))

    def try_now(self, item: Any) -> bool:
        """The busy loop: send `item` now; False when it must queue (see the module doc)."""
        if not self.lock.acquire(blocking=False):
            return False
        try:
            if self.sock is None or self.queued:
                return False
            try:
                self.send(item, zmq.NOBLOCK)
            except zmq.Again:
                return False
            return True
        finally:
            self.lock.release()
