"""The `nixl-pull-reader` thread: the shared transfer thread with pull mode's routes.

It self-polls while D has READs staged or in flight or completions waiting for a peer, or P
holds leased blocks (a READ of them progresses only while P is polled too), and otherwise
sleeps until the next heartbeat is due.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from kvconnector import wire
from kvconnector.peers import Peers
from kvconnector.pull.lender import Lender
from kvconnector.pull.reader import Reader
from kvconnector.transfer_thread import TransferThread


class PullThread(TransferThread):
    def __init__(self, transport: Any, peers: Peers, lender: Lender, reader: Reader,
                 wake: threading.Event, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(
            "nixl-pull-reader", transport, peers, lender, reader, wake, clock,
            inbox_routes={  # PullMeta field -> handler
                "leases": lender.on_lease,
                "claims": reader.on_claim,
                "reads": reader.on_read,
                "abandoned": reader.on_abandoned,
                "released": reader.on_released,
            },
            notif_routes={
                wire.Heartbeat: lambda m, _a, _s: lender.on_heartbeat(list(m.transfer_ids)),
                wire.Completion: lambda m, _a, _s: lender.on_completion(m.request_id),
            },
        )
        self.lender = lender
        self.reader = reader

    def counters(self) -> dict[str, float]:
        return dict(self.lender.stats)  # one dict, shared by both halves
