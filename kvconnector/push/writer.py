"""The `nixl-push-writer` thread: sole owner of this worker's NIXL notifications and WRITEs.

Wakes on its event: `start_load_kv` (only when the step brings new work), `get_finished`
(every step), a finished handshake, or its own timer. It polls every 1 ms only while it
has outstanding work (P: staged blocks or WRITEs in flight; D: registrations awaiting
their WRITE, which needs this side's progress too) and otherwise sleeps, so an idle
engine costs no CPU. Cross-thread hand-off: one inbox in, one outbox out.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from kvconnector import wire
from kvconnector.push.peers import Peers
from kvconnector.push.receiver import Receiver
from kvconnector.push.sender import Sender
from kvconnector.wake_thread import WakeThread

logger = logging.getLogger(__name__)

_PRUNE_EVERY_S = 1.0


class PushWriter(WakeThread):
    def __init__(self, transport: Any, peers: Peers, sender: Sender, receiver: Receiver,
                 wake: threading.Event, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__("nixl-push-writer", transport, peers, sender, receiver, wake, clock)
        self.sender = sender
        self.receiver = receiver
        self._last_listen = clock()  # when this side last drained its notifications
        self._next_prune = clock() + _PRUNE_EVERY_S

    def step(self) -> None:
        """One pass: handshakes, scheduler work, inbound notifs, polls, results out."""
        self.peers.apply_finished()
        self._drain_inbox()
        # A notification first seen now was not there at the previous drain, so it was sent
        # after about then: date it so. Dating it "now" would let a P that was frozen (or
        # starved) for longer than the ttl take a stale PUSH_REG for a fresh one and WRITE
        # into blocks D has long given to other requests.
        listened, self._last_listen = self._last_listen, self.clock()
        for agent, raw in self.t.get_new_notifs():
            try:
                self._dispatch(raw, listened, agent)
            except Exception:  # noqa: BLE001 - one bad message must not lose the batch
                self.malformed += 1
                logger.exception("notification from %s dropped: %r", agent, raw[:64])
        self.sender.poll()
        self.receiver.poll()
        self._prune_idle_peers()
        self._publish()

    def _prune_idle_peers(self) -> None:
        now = self.clock()
        if now < self._next_prune:
            return
        self._next_prune = now + _PRUNE_EVERY_S
        self.peers.prune(self.sender.addresses_in_use() | self.receiver.addresses_in_use())

    def _drain_inbox(self) -> None:
        while True:
            try:
                meta = self.inbox.get_nowait()
            except queue.Empty:
                return
            for q in meta.queued:
                self.receiver.on_queued(q)
            for reg in meta.registrations:
                self.receiver.on_registration(reg)
            for rid in meta.watchdog_expired:
                self.receiver.on_watchdog(rid)
            for rid in meta.released:
                self.receiver.on_released(rid)
            for fb in meta.finished_blocks:
                self.sender.on_finished_blocks(fb)
            for rid, tid in meta.aborted:
                self.sender.on_aborted(rid, tid)

    def _dispatch(self, raw: bytes, seen_after: float, agent: str) -> None:
        """`agent`: the sender's NIXL agent name; the halves refuse (and count) a message from
        an agent other than the one the transfer belongs to."""
        try:
            msg = wire.decode_notif(raw)
        except wire.MalformedNotif as e:
            self.malformed += 1
            logger.warning("malformed notification dropped (%s): %r", e, raw[:64])
            return
        if isinstance(msg, wire.PushReg):
            self.sender.on_registration(msg, received_at=seen_after, agent=agent)
        elif isinstance(msg, wire.Heartbeat):
            self.sender.on_heartbeat(list(msg.transfer_ids), agent)
        elif isinstance(msg, wire.PushCancel):
            self.sender.on_cancel(msg.request_id, msg.transfer_id, agent)
        elif isinstance(msg, wire.Completion):
            self.receiver.on_completion(msg.request_id, agent)
        elif isinstance(msg, wire.PushFail):
            self.receiver.on_push_fail(msg.request_id, msg.reason, agent)
        elif isinstance(msg, wire.PushCancelAck):
            self.receiver.on_cancel_ack(msg.request_id, agent)
