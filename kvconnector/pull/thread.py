"""The `nixl-pull-reader` thread: sole owner of this worker's NIXL notifications and READs.

Wakes on its event: `start_load_kv` (only when the step brings new work), `get_finished`
(every step), a finished handshake, or its own timer. It polls every 1 ms only while work
is outstanding (D: READs staged or in flight, completions waiting for a peer; P: leased
blocks, which a READ progresses on only while P is polled too; handshakes pending) and
otherwise sleeps until the next heartbeat is due, so an idle engine costs no CPU.
Cross-thread hand-off: one inbox in, one outbox out.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from engine.kv_connector import KVConnectorOutput
from kvconnector import wire
from kvconnector.pull.lender import Lender
from kvconnector.pull.meta import PullMeta
from kvconnector.pull.reader import Reader
from kvconnector.push.peers import Peers

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.001
_IDLE_TICK_S = 1.0  # upper bound on a sleep, so a lost wake costs at most this


class PullThread:
    def __init__(self, transport: Any, peers: Peers, lender: Lender, reader: Reader,
                 wake: threading.Event, clock: Callable[[], float] = time.monotonic) -> None:
        self.t = transport
        self.peers = peers
        self.lender = lender
        self.reader = reader
        self.wake = wake
        self.clock = clock
        self.inbox: queue.SimpleQueue[PullMeta] = queue.SimpleQueue()
        self.outbox: queue.SimpleQueue[KVConnectorOutput] = queue.SimpleQueue()
        self.malformed = 0  # undecodable, or a push-mode message sent to a pull engine
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="nixl-pull-reader", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self.wake.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop:
            self.wake.wait(self._timeout())
            self.wake.clear()
            try:
                self.step()
            except Exception:  # noqa: BLE001 - log and go on; the engine must not lose it
                logger.exception("pull thread step failed")

    def _timeout(self) -> float:
        if self.lender.needs_poll() or self.reader.needs_poll() or self.peers.pending():
            return POLL_INTERVAL_S
        deadline = self.reader.next_deadline()
        if deadline is None:
            return _IDLE_TICK_S
        return min(_IDLE_TICK_S, max(POLL_INTERVAL_S, deadline - self.clock()))

    def step(self) -> None:
        """One pass: handshakes, scheduler work, inbound notifs, polls, results out."""
        self.peers.apply_finished()
        self._drain_inbox()
        for agent, raw in self.t.get_new_notifs():
            self._dispatch(agent, raw)
        self.lender.poll()
        self.reader.poll()
        self._publish()

    def _drain_inbox(self) -> None:
        while True:
            try:
                meta = self.inbox.get_nowait()
            except queue.Empty:
                return
            for lease in meta.leases:
                self.lender.on_lease(lease)
            for claim in meta.claims:
                self.reader.on_claim(claim)
            for read in meta.reads:
                self.reader.on_read(read)
            for rid in meta.abandoned:
                self.reader.on_abandoned(rid)
            for rid in meta.released:
                self.reader.on_released(rid)

    def _dispatch(self, agent: str, raw: bytes) -> None:
        try:
            msg = wire.decode_notif(raw)
        except wire.MalformedNotif as e:
            self.malformed += 1
            logger.warning("malformed notification from %s dropped (%s)", agent, e)
            return
        if isinstance(msg, wire.Heartbeat):
            self.lender.on_heartbeat(list(msg.transfer_ids))
        elif isinstance(msg, wire.Completion):
            self.lender.on_completion(msg.request_id)
        else:
            self.malformed += 1
            logger.warning("%s from %s dropped: not a pull-mode notification",
                           type(msg).__name__, agent)

    def _publish(self) -> None:
        lender, reader = self.lender, self.reader
        if not (lender.done or reader.done or reader.finished_recving or reader.failed_recving):
            return
        out = KVConnectorOutput(
            finished_sending=lender.done | reader.done,
            finished_recving=set(reader.finished_recving),
            failed_recving=dict(reader.failed_recving),
        )
        lender.done, reader.done = set(), set()
        reader.finished_recving, reader.failed_recving = set(), {}
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
