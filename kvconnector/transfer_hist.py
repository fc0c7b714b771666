"""Transfer timings as Prometheus histograms: a half counts a finished transfer (or wait) into
cumulative bucket keys `<name>_bucket:<le>` of its stats dict (summed over TP ranks like every
counter); the engine's metrics render them as the family's buckets (the spec's `summaries`).

- `kv_transfer_seconds` (P in push mode, D in pull mode): a transfer's own time, from the WRITE
  posted when P matched D's registration (pull: the READ posted) to its completion.
- `kv_wait_seconds` (D): a D leg's wait for its KV, from its arrival at D's scheduler
  (`on_request_added`) to the scheduler taking the KV's landing (`update_connector_output`):
  P's queue, P's prefill, the transfer and D noticing it. Legs whose KV never lands (failed,
  aborted) are not counted.
"""

from __future__ import annotations

NAME = "kv_transfer_seconds"
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
WAIT_NAME = "kv_wait_seconds"
# a wait holds P's queue and prefill: up to the registration watchdog (480 s by default)
WAIT_BUCKETS = (*BUCKETS, 60.0, 120.0, 480.0)


def _keys(name: str, buckets: tuple[float, ...]) -> tuple[str, ...]:
    return tuple(f"{name}_bucket:{le}" for le in buckets)


_BUCKETS = {NAME: BUCKETS, WAIT_NAME: WAIT_BUCKETS}
_KEYS = {name: _keys(name, b) for name, b in _BUCKETS.items()}


def initial(name: str = NAME) -> dict[str, float]:
    """The histogram's keys at zero (_sum, _count and every finite bucket)."""
    return {f"{name}_sum": 0.0, f"{name}_count": 0, **dict.fromkeys(_KEYS[name], 0)}


def observe(stats: dict[str, float], seconds: float, name: str = NAME) -> None:
    """Count one transfer (or wait) of `seconds` into `stats` (keys missing there start at 0)."""
    stats[f"{name}_sum"] = stats.get(f"{name}_sum", 0.0) + seconds
    stats[f"{name}_count"] = stats.get(f"{name}_count", 0) + 1
    for le, key in zip(_BUCKETS[name], _KEYS[name], strict=True):
        if seconds <= le:
            stats[key] = stats.get(key, 0) + 1
