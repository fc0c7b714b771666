"""The `nixl-push-transfer` thread: the shared transfer thread with push mode's routes. It runs
on both roles: on P it holds the `Sender` (matches registrations, WRITEs), on D the `Receiver`
(registers blocks, awaits the WRITE) — D writes nothing, so neither the thread nor the class is
named for writing.

It self-polls while P has staged blocks or WRITEs in flight, or D has registrations awaiting
their WRITE (which needs this side's progress too), and prunes idle peers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvconnector import wire
from kvconnector.push.receiver import Receiver
from kvconnector.push.sender import Sender
from kvconnector.transfer_thread import NotifHandler, TransferThread


class PushThread(TransferThread):
    """`PushThread(transport, peers, sender, receiver, wake, clock)`."""

    name = "nixl-push-transfer"
    prune_idle = True
    sink_waits_for_poke = True  # P pokes D's side channel when it posts a WRITE into D
    # ... and when it sends D a PUSH_FAIL or a PUSH_CANCEL_ACK (a kv_both engine's PUSH_REGs
    # and heartbeats come unannounced)
    poked_kinds = frozenset({wire.Completion, wire.PushFail, wire.PushCancelAck})
    source: Sender
    sink: Receiver

    @property
    def sender(self) -> Sender:
        return self.source

    @property
    def receiver(self) -> Receiver:
        return self.sink

    def make_inbox_routes(self) -> dict[str, Callable[[Any], None]]:
        s, r = self.source, self.sink
        return {  # PushMeta field -> handler
            "queued": r.on_queued,
            "registrations": r.on_registration,
            "watchdog_expired": r.on_watchdog,
            "released": r.on_released,
            "arrived": lambda a: s.on_arrived(*a),  # before the same request's end
            "finished_blocks": s.on_finished_blocks,
            "aborted": lambda a: s.on_aborted(*a),
        }

    def make_notif_routes(self) -> dict[type, NotifHandler]:
        s, r = self.source, self.sink
        return {
            wire.PushReg: lambda m, agent, seen: s.on_registration(m, received_at=seen,
                                                                   agent=agent),
            wire.Heartbeat: lambda m, agent, _: s.on_heartbeat(list(m.transfer_ids), agent),
            wire.PushCancel: lambda m, agent, _: s.on_cancel(m.request_id, m.transfer_id, agent),
            wire.Completion: lambda m, agent, _: r.on_completion(m.request_id, agent,
                                                                 m.first_token),
            wire.PushFail: lambda m, agent, _: r.on_push_fail(m.request_id, m.reason, agent),
            wire.PushCancelAck: lambda m, agent, _: r.on_cancel_ack(m.request_id, agent),
        }

    def stop(self) -> None:
        super().stop()
        if self.source.poker is not None:
            self.source.poker.close()

    def counters(self) -> dict[str, float]:
        poker = self.source.poker
        return {**self.source.stats.counters, **self.sink.stats,
                "kv_pokes_sent_total": 0 if poker is None else poker.sent,
                "kv_refused_notifs_total": self.source.refused + self.sink.refused}
