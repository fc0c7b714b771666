"""The `nixl-pull-transfer` thread: the shared transfer thread with pull mode's routes. It runs
on both roles: on P it holds the `Lender` (leases, reads nothing), on D the `Reader`.

It self-polls while D has READs staged or in flight or completions waiting for a peer, or P
holds leased blocks (a READ of them progresses only while P is polled too), and otherwise
sleeps until the next heartbeat is due.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvconnector import wire
from kvconnector.pull.lender import Lender
from kvconnector.pull.reader import Reader
from kvconnector.transfer_thread import NotifHandler, TransferThread


class PullThread(TransferThread):
    """`PullThread(transport, peers, lender, reader, wake, clock)`."""

    name = "nixl-pull-transfer"
    source: Lender
    sink: Reader

    def make_inbox_routes(self) -> dict[str, Callable[[Any], None]]:
        return {  # PullMeta field -> handler
            "leases": self.source.on_lease,
            "claims": self.sink.on_claim,
            "reads": self.sink.on_read,
            "abandoned": self.sink.on_abandoned,
            "released": self.sink.on_released,
        }

    def make_notif_routes(self) -> dict[type, NotifHandler]:
        lender = self.source  # P is passive: D's notifications only touch its leases
        return {
            wire.Heartbeat: lambda m, _agent, _seen: lender.on_heartbeat(list(m.transfer_ids)),
            wire.Completion: lambda m, _agent, _seen: lender.on_completion(m.request_id),
        }

    def counters(self) -> dict[str, float]:
        return dict(self.source.stats)  # one dict, shared by both halves
