"""kv_transfer_seconds as a Prometheus histogram: each half counts a finished transfer into
cumulative bucket keys `kv_transfer_seconds_bucket:<le>` of its stats dict (summed over TP
ranks like every counter); the engine's metrics render them as the family's buckets."""

from __future__ import annotations

NAME = "kv_transfer_seconds"
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_KEYS = tuple(f"{NAME}_bucket:{le}" for le in BUCKETS)


def initial() -> dict[str, float]:
    """The histogram's keys at zero (_sum, _count and every finite bucket)."""
    return {f"{NAME}_sum": 0.0, f"{NAME}_count": 0, **dict.fromkeys(_KEYS, 0)}


def observe(stats: dict[str, float], seconds: float) -> None:
    """Count one transfer of `seconds` into `stats` (keys missing there start at 0)."""
    stats[f"{NAME}_sum"] = stats.get(f"{NAME}_sum", 0.0) + seconds
    stats[f"{NAME}_count"] = stats.get(f"{NAME}_count", 0) + 1
    for le, key in zip(BUCKETS, _KEYS, strict=True):
        if seconds <= le:
            stats[key] = stats.get(key, 0) + 1
