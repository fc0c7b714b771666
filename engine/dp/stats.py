"""One `get_stats` answer for a data-parallel server: numbers summed over the live engines
(so leak checks — free blocks back to total, empty tables — read as before), each rank's own
answer under `engines`, and the ranks that died under `dead_engines`."""

from __future__ import annotations

from typing import Any


def merge_stats(per_rank: dict[int, dict[str, Any]], dead: list[int],
                balancer: Any = None) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for stats in per_rank.values():
        for key, value in stats.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                merged.setdefault(key, value)
            else:
                merged[key] = merged.get(key, 0) + value
    merged["engines"] = {str(r): s for r, s in sorted(per_rank.items())}
    merged["dead_engines"] = dead
    if balancer is not None:
        merged["dp_outstanding"] = list(balancer.outstanding)
        merged["dp_published_counts"] = [list(c) for c in balancer.counts]
        merged["dp_publications"] = balancer.num_publications
        merged["dp_coordinator_alive"] = balancer.have_coordinator
    return merged
