"""P side of pull mode: prompt blocks leased to a decode engine that READs them.

Owned by the pull thread. P is passive: D's READ moves the bytes; P only has to keep the
blocks untouched until D is done with them. Guarantees:
- every lease is reported free-able (`done`) exactly once: on D's completion notification
  `<P request id>:<tp>` (D sends it once its READ is over, or once it decides not to read),
  or when the lease expires (`kv_lease_duration`, extended by D's heartbeats `HB:<P ids>`);
- a completion or heartbeat for an unknown id (late, duplicated, replayed) changes nothing.
While any lease is held the thread polls NIXL (a READ targeting these blocks progresses only
while this side is polled too).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvconnector.pull.meta import Lease

logger = logging.getLogger(__name__)


class Lender:
    def __init__(self, clock: Callable[[], float], *, lease: float,
                 stats: dict[str, float]) -> None:
        self.clock = clock
        self.lease = lease
        self.stats = stats
        self.leases: dict[str, float] = {}  # P request id -> deadline
        self.done: set[str] = set()  # P ids whose blocks may be freed

    def on_lease(self, lease: Lease) -> None:
        self.leases[lease.request_id] = self.clock() + self.lease
        self.stats["kv_pull_leases_total"] += 1

    def on_heartbeat(self, request_ids: list[str]) -> None:
        deadline = self.clock() + self.lease
        for rid in request_ids:
            if rid in self.leases:
                self.leases[rid] = max(self.leases[rid], deadline)

    def on_completion(self, request_id: str) -> bool:
        """D is done with these blocks. Returns whether the id named a live lease."""
        if self.leases.pop(request_id, None) is None:
            logger.info("completion for %s, which holds no lease (expired or repeated)",
                        request_id)
            return False
        self.stats["kv_pull_leases_returned_total"] += 1
        self.done.add(request_id)
        return True

    def poll(self) -> None:
        now = self.clock()
        for rid, deadline in list(self.leases.items()):
            if now >= deadline:
                del self.leases[rid]
                self.stats["kv_lease_expired_total"] += 1
                logger.warning("lease of %s expired after %.1fs without D's completion; "
                               "freeing its blocks", rid, self.lease)
                self.done.add(rid)

    def needs_poll(self) -> bool:
        return bool(self.leases)

    def next_deadline(self) -> float | None:
        return None  # polled while it holds a lease

    def table_sizes(self) -> dict[str, int]:
        return {"pull_leases": len(self.leases)}
