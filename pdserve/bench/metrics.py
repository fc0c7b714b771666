"""Summary statistics of a serving benchmark, with vLLM `bench serve`'s JSON keys.

Pure functions over `RequestResult`s: every latency statistic is over the successful
requests only, in milliseconds; throughputs divide by the benchmark's wall-clock duration.
An empty sample gives 0.0 for each statistic (as vLLM does), never NaN, so the JSON is strict.

Per metric M in ttft, tpot, itl, e2el the summary has mean_M_ms, median_M_ms, std_M_ms,
pP_M_ms for each requested percentile P, and percentiles_M_ms = [[P, value], …].
Goodput: requests per second whose every measured metric named in the SLOs is within it
(ttft, tpot, e2el in ms; a request with one output token has no tpot and meets a tpot SLO).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pdserve.bench.client import RequestResult

METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] → {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"bad --goodput item {item!r}: expected NAME:MS with NAME one of "
                             f"{', '.join(GOODPUT_METRICS)}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"bad --goodput item {item!r}: {value!r} is not a number") from None
        if slos[name] <= 0:
            raise ValueError(f"bad --goodput item {item!r}: the SLO must be positive")
    return slos


def parse_percentiles(text: str) -> list[float]:
    values = [float(p) for p in text.split(",") if p.strip()]
    if not values or any(not 0 < p < 100 for p in values):
        raise ValueError(f"bad --metric-percentiles {text!r}: expected values in (0, 100)")
    return values


def _pkey(p: float) -> str:
    return f"{p:g}".replace(".", "_")


def _stats(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, Any]:
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    empty = ms.size == 0
    out: dict[str, Any] = {
        f"mean_{name}_ms": 0.0 if empty else float(ms.mean()),
        f"median_{name}_ms": 0.0 if empty else float(np.median(ms)),
        f"std_{name}_ms": 0.0 if empty else float(ms.std()),
    }
    pairs = [[p, 0.0 if empty else float(np.percentile(ms, p))] for p in percentiles]
    for p, v in pairs:
        out[f"p{_pkey(p)}_{name}_ms"] = v
    out[f"percentiles_{name}_ms"] = pairs
    return out


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    measured = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency}
    return r.success and all(measured[k] is None or measured[k] * 1000.0 <= v
                             for k, v in slos.items())


def summarize(results: Sequence[RequestResult], duration: float, *,
              percentiles: Sequence[float] = DEFAULT_PERCENTILES,
              slos: dict[str, float] | None = None) -> dict[str, Any]:
    """The summary of one run (see module docstring). `duration` is in seconds, > 0."""
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}")
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len or 0 for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    if slos:
        good = sum(1 for r in ok if meets_slos(r, slos))
        summary["request_goodput"] = good / duration
        summary["goodput"] = summary["request_goodput"]
        summary["goodput_slos_ms"] = dict(slos)
    samples = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    for name in METRICS:
        summary.update(_stats(name, samples[name], percentiles))
    return summary


def summarize_by_kind(results: Sequence[RequestResult], duration: float, *,
                      percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                      slos: dict[str, float] | None = None,
                      key: str = "kind") -> dict[str, dict[str, Any]]:
    """One summary per workload class (or per other RequestResult field `key`, such as
    "target"); throughputs are still over the whole run's duration."""
    groups = sorted({getattr(r, key) for r in results})
    return {g: summarize([r for r in results if getattr(r, key) == g], duration,
                         percentiles=percentiles, slos=slos) for g in groups}
