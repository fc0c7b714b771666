"""One `get_stats` answer for a data-parallel server: numbers summed over the live engines
(so leak checks — free blocks back to total, empty tables — read as before), each rank's own
answer under `engines`, and the ranks that died under `dead_engines`."""

from __future__ import annotations

from typing import Any


def merge_stats(per_rank: dict[int, dict[str, Any]], client: Any) -> dict[str, Any]:
    """`client`: the DPLBAsyncClient (its balancer, engines, coordinator, dead ranks)."""
    merged: dict[str, Any] = {}
    for stats in per_rank.values():
        for key, value in stats.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                merged.setdefault(key, value)
            else:
                merged[key] = merged.get(key, 0) + value
    merged["engines"] = {str(r): s for r, s in sorted(per_rank.items())}
    balancer = client.balancer
    merged["dead_engines"] = sorted(client.engine_errors)
    merged["dp_outstanding"] = list(balancer.outstanding)
    merged["dp_published_counts"] = [list(c) for c in balancer.counts]
    merged["dp_publications"] = balancer.num_publications
    merged["dp_coordinator_alive"] = balancer.have_coordinator
    merged["dp_engine_pids"] = [e.core.pid for e in client.engines]
    merged["dp_coordinator_pid"] = client.coordinator.proc.pid
    return merged
