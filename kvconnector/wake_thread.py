"""The transfer thread both connectors run: sole owner of a worker's NIXL notifications
and transfers, woken by an event and polling only while work is outstanding.

A subclass supplies `step()` (drain its inbox, dispatch notifications, poll its halves)
and two halves: `source` (this engine's blocks other engines take: P side) and `sink`
(blocks this engine receives: D side). Each half has `needs_poll()` and a `done` set of
request ids whose blocks may be freed; the sink also has `next_deadline()`,
`finished_recving` and `failed_recving`. Cross-thread hand-off: one inbox in, one outbox
out; the engine thread reads the outbox with `collect()`.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from engine.kv_connector import KVConnectorOutput

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.001
_IDLE_TICK_S = 1.0  # upper bound on a sleep, so a lost wake costs at most this


class WakeThread:
    def __init__(self, name: str, transport: Any, peers: Any, source: Any, sink: Any,
                 wake: threading.Event, clock: Callable[[], float]) -> None:
        self.t = transport
        self.peers = peers
        self._source = source
        self._sink = sink
        self.wake = wake
        self.clock = clock
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.outbox: queue.SimpleQueue[KVConnectorOutput] = queue.SimpleQueue()
        self.malformed = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self.wake.set()
        self._thread.join(timeout=5)

    def step(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop:
            self.wake.wait(self._timeout())
            self.wake.clear()
            try:
                self.step()
            except Exception:  # noqa: BLE001 - log and go on; the engine must not lose it
                logger.exception("%s step failed", self._thread.name)

    def _timeout(self) -> float:
        if self._source.needs_poll() or self._sink.needs_poll() or self.peers.pending():
            return POLL_INTERVAL_S
        deadline = self._sink.next_deadline()
        if deadline is None:
            return _IDLE_TICK_S
        return min(_IDLE_TICK_S, max(POLL_INTERVAL_S, deadline - self.clock()))

    def _publish(self) -> None:
        src, sink = self._source, self._sink
        if not (src.done or sink.done or sink.finished_recving or sink.failed_recving):
            return
        out = KVConnectorOutput(
            finished_sending=src.done | sink.done,
            finished_recving=set(sink.finished_recving),
            failed_recving=dict(sink.failed_recving),
        )
        src.done, sink.done = set(), set()
        sink.finished_recving, sink.failed_recving = set(), {}
        self.outbox.put(out)

    def collect(self) -> KVConnectorOutput:
        """Engine thread: everything the thread finished since the last call."""
        out = KVConnectorOutput()
        while True:
            try:
                part = self.outbox.get_nowait()
            except queue.Empty:
                return out
            out.finished_sending |= part.finished_sending
            out.finished_recving |= part.finished_recving
            out.failed_recving.update(part.failed_recving)
