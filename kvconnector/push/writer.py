"""The `nixl-push-writer` thread: the shared transfer thread with push mode's routes.

It self-polls while P has staged blocks or WRITEs in flight, or D has registrations awaiting
their WRITE (which needs this side's progress too), and prunes idle peers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from kvconnector import wire
from kvconnector.peers import Peers
from kvconnector.push.receiver import Receiver
from kvconnector.push.sender import Sender
from kvconnector.transfer_thread import TransferThread


class PushWriter(TransferThread):
    def __init__(self, transport: Any, peers: Peers, sender: Sender, receiver: Receiver,
                 wake: threading.Event, clock: Callable[[], float] = time.monotonic) -> None:
        s, r = sender, receiver
        super().__init__(
            "nixl-push-writer", transport, peers, sender, receiver, wake, clock,
            inbox_routes={  # PushMeta field -> handler
                "queued": r.on_queued,
                "registrations": r.on_registration,
                "watchdog_expired": r.on_watchdog,
                "released": r.on_released,
                "finished_blocks": s.on_finished_blocks,
                "aborted": lambda a: s.on_aborted(*a),
            },
            notif_routes={
                wire.PushReg: lambda m, agent, seen: s.on_registration(
                    m, received_at=seen, agent=agent),
                wire.Heartbeat: lambda m, agent, _: s.on_heartbeat(list(m.transfer_ids), agent),
                wire.PushCancel: lambda m, agent, _: s.on_cancel(m.request_id, m.transfer_id,
                                                                 agent),
                wire.Completion: lambda m, agent, _: r.on_completion(m.request_id, agent),
                wire.PushFail: lambda m, agent, _: r.on_push_fail(m.request_id, m.reason, agent),
                wire.PushCancelAck: lambda m, agent, _: r.on_cancel_ack(m.request_id, agent),
            },
            prune_idle=True,
        )
        self.sender = sender
        self.receiver = receiver

    def counters(self) -> dict[str, float]:
        return {**self.sender.stats.counters, **self.receiver.stats,
                "kv_refused_notifs_total": self.sender.refused + self.receiver.refused}
