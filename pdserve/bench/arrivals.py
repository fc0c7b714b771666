"""When each request of a benchmark is sent.

`request_rate` = inf sends everything at once. Otherwise the gaps between sends are drawn from
a gamma distribution with shape `burstiness` and mean 1 / `request_rate`: burstiness 1 is a
Poisson process, below 1 burstier, above 1 more regular (as in vLLM's bench serve).
The schedule is a list of offsets from the start, so a slow client never compresses it.
"""

from __future__ import annotations

import math

import numpy as np


def send_offsets(n: int, request_rate: float, burstiness: float = 1.0,
                 seed: int = 0) -> list[float]:
    """Seconds after the start at which each of `n` requests is sent (non-decreasing)."""
    if request_rate <= 0:
        raise ValueError(f"request rate must be positive, got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    theta = 1.0 / (request_rate * burstiness)
    gaps = rng.gamma(shape=burstiness, scale=theta, size=n)
    gaps[0] = 0.0  # the first request goes out at once
    return [float(x) for x in np.cumsum(gaps)]
