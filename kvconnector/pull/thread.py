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

from kvconnector import wire
from kvconnector.pull.lender import Lender
from kvconnector.pull.reader import Reader
from kvconnector.push.peers import Peers
from kvconnector.wake_thread import WakeThread

logger = logging.getLogger(__name__)


class PullThread(WakeThread):
    def __init__(self, transport: Any, peers: Peers, lender: Lender, reader: Reader,
                 wake: threading.Event, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__("nixl-pull-reader", transport, peers, lender, reader, wake, clock)
        self.lender = lender
        self.reader = reader

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
