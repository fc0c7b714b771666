"""Which engine gets the next request (seed 000's DP load-balancing client).

score = waiting * 4 + running, from the counts the coordinator published last, where
`waiting` also counts the requests this client sent to that engine since the engine last
reported (so a burst between two reports does not all land on the engine that looked idle;
an engine inside a long step reports nothing, and its count keeps growing meanwhile). Ties rotate
the scan start. Without a coordinator (it died) the client's own outstanding requests per
engine are the counts. `round_robin` (PDSERVE_DP_LB=round_robin) is the bench baseline.
"""

from __future__ import annotations

import os

POLICIES = ("score", "round_robin")


class Balancer:
    def __init__(self, num_engines: int, policy: str | None = None) -> None:
        policy = policy or os.environ.get("PDSERVE_DP_LB", "score")
        if policy not in POLICIES:
            raise ValueError(f"PDSERVE_DP_LB must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.counts = [[0, 0] for _ in range(num_engines)]  # published [waiting, running]
        self.sent_since = [0] * num_engines  # our sends since the engine's last report
        self.stamps: list[int] | None = None  # per rank: reports the coordinator had
        self.outstanding = [0] * num_engines  # our requests not finished yet
        self.alive = [True] * num_engines
        self.have_coordinator = True
        self.num_publications = 0
        self._next = 0

    def publish(self, counts: list[list[int]], stamps: list[int] | None = None) -> None:
        """A coordinator publication. Our sends to a rank are forgotten once that rank
        reported again (its stamp moved); without stamps, at every publication."""
        n = len(self.counts)
        if len(counts) != n or (stamps and len(stamps) != n):
            raise ValueError(f"published counts for {len(counts)} engines, expected {n}")
        self.counts = [[int(w), int(r)] for w, r in counts]
        for rank in range(n):
            if not stamps or self.stamps is None or stamps[rank] != self.stamps[rank]:
                self.sent_since[rank] = 0
        self.stamps = list(stamps) if stamps else None
        self.num_publications += 1

    def score(self, rank: int) -> int:
        if not self.have_coordinator:
            return self.outstanding[rank]
        waiting, running = self.counts[rank]
        return (waiting + self.sent_since[rank]) * 4 + running

    def pick(self) -> int:
        """The rank for an unpinned request; raises LookupError when no engine is alive."""
        n = len(self.counts)
        order = [(self._next + i) % n for i in range(n)]
        live = [r for r in order if self.alive[r]]
        if not live:
            raise LookupError("no data-parallel engine is alive")
        self._next = (self._next + 1) % n
        if self.policy == "round_robin":
            return live[0]
        return min(live, key=self.score)  # min keeps the first of equal scores

    def sent(self, rank: int) -> None:
        self.sent_since[rank] += 1
        self.outstanding[rank] += 1

    def finished(self, rank: int) -> None:
        self.outstanding[rank] = max(0, self.outstanding[rank] - 1)
