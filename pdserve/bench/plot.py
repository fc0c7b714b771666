"""CDF plots of latencies (matplotlib, imported only when a plot is asked for)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

# rows[row title][series label][metric] = latencies in ms
Grid = Mapping[str, Mapping[str, Mapping[str, Sequence[float]]]]


def plot_cdf_grid(rows: Grid, path: str, title: str = "") -> None:
    """One row of panels per entry of `rows`, one panel per metric (the metrics of the row's
    first series), one line per series; x axis in log scale. Writes a PNG to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    rows = {k: v for k, v in rows.items() if v}
    ncols = max((len(next(iter(r.values()))) for r in rows.values()), default=1)
    fig, axes = plt.subplots(max(len(rows), 1), ncols, figsize=(6.5 * ncols, 4.2 * len(rows)),
                             squeeze=False)
    for axrow, (row_title, series) in zip(axes, rows.items(), strict=False):
        metrics = list(next(iter(series.values())).keys())
        for ax, metric in zip(axrow, metrics, strict=False):
            for label, data in series.items():
                values = np.sort(np.asarray(data.get(metric, ()), dtype=np.float64))
                values = values[values > 0]
                if values.size == 0:
                    continue
                ax.plot(values, np.arange(1, values.size + 1) / values.size, label=label)
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel(f"{metric} (ms, log scale)")
            ax.set_ylabel("fraction ≤ x")
            ax.set_title(f"{row_title}: {metric} CDF" if row_title else f"{metric} CDF")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_cdfs(series: Mapping[str, Mapping[str, Sequence[float]]], path: str,
              title: str = "") -> None:
    """A single row: `series[label][metric]` latencies in ms."""
    plot_cdf_grid({"": series}, path, title)
