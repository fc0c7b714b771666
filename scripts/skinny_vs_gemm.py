"""The skinny kernel against the gemm beyond it, on one layer's weights or on every layer's.

Times `skinny_linear` and `large_linear` (the gemm `linear` uses beyond the skinny rows) on
bench-llama's four layer shapes at 8-64 rows, each call over LAYERS copies of the weights (each
a tensor of its own), best of 20 rounds: with 1 copy the weights stay in the cache from call to
call, with 8 (the model's layers) they come from memory as a decode step's do. The ratio is
the kernel's time over the gemm's (below 1: the kernel wins).

usage: python scripts/skinny_vs_gemm.py THREADS DTYPE LAYERS (from the repo root)
"""

from __future__ import annotations

import sys
import time

import torch
from decode_kernels_ab import best  # the same directory

from engine import kernels
from engine.kernels import linear as el

SHAPES = [(1024, 512), (512, 512), (2816, 512), (512, 1408)]  # bench-llama's [out, in]


def best_of(fn, ws: list[torch.Tensor], xs: dict[int, torch.Tensor]) -> float:
    """Best of 20 calls of fn over every weight in ws, after a warm one."""
    def run() -> None:
        for w in ws:
            fn(xs[w.shape[1]], w)

    run()
    return best(run, time.perf_counter, 20)


def main() -> None:
    threads, dtype, layers = int(sys.argv[1]), getattr(torch, sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(threads)
    el.set_gemm_shapes(SHAPES, layers)
    kernel = kernels.compiled()
    ws = [torch.randn(o, i).to(dtype) for _ in range(layers) for o, i in SHAPES]
    mib = sum(w.numel() * w.element_size() for w in ws) / 2**20
    for rows in (8, 16, 32, 64):
        xs = {i: torch.randn(rows, i).to(dtype) for _, i in SHAPES}
        k = best_of(kernel.skinny_linear, ws, xs)
        g = best_of(el.large_linear, ws, xs)
        print(f"{sys.argv[2]} {threads} thr, {layers} layers ({mib:.0f} MiB), {rows:3d} rows: "
              f"kernel {k * 1e3:.3f} ms, gemm {g * 1e3:.3f} ms, kernel/gemm {k / g:.2f}")


if __name__ == "__main__":
    main()
