"""CDF plots of TTFT and ITL (matplotlib, imported only when a plot is asked for)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def plot_cdfs(series: Mapping[str, Mapping[str, Sequence[float]]], path: str,
              title: str = "") -> None:
    """One panel per metric; `series[label][metric]` are latencies in milliseconds.
    Metrics: the keys of the first series (e.g. "TTFT", "ITL"), x axis in log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = list(next(iter(series.values())).keys()) if series else []
    fig, axes = plt.subplots(1, max(len(metrics), 1), figsize=(6 * max(len(metrics), 1), 4.5),
                             squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=False):
        for label, data in series.items():
            values = np.sort(np.asarray(data.get(metric, ()), dtype=np.float64))
            if values.size == 0:
                continue
            ax.plot(values, np.arange(1, values.size + 1) / values.size, label=label)
        ax.set_xscale("log")
        ax.set_xlabel(f"{metric} (ms, log scale)")
        ax.set_ylabel("fraction of samples ≤ x")
        ax.set_title(f"{metric} CDF")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
