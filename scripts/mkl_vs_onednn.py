"""The two BLAS-side float32 gemms `large_linear` chooses between (engine/kernels/linear.py):
F.linear (MKL) and oneDNN's matmul, on one layer of the bench model's weight shapes, at
1 and 2 threads and 16-2048 rows; best of 5 each, GFLOP/s and oneDNN / MKL.

usage: python scripts/mkl_vs_onednn.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from engine.kernels.linear import onednn_linear

SHAPES = [(1024, 512), (512, 512), (2816, 512), (512, 1408)]  # bench-llama's layer, [out, in]


def gflops(gemm, ws: list[torch.Tensor], xs: dict[int, torch.Tensor], rows: int) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for w in ws:
            gemm(xs[w.shape[1]], w)
        best = min(best, time.perf_counter() - start)
    return 2 * rows * sum(w.numel() for w in ws) / best / 1e9


def main() -> None:
    ws = [torch.randn(o, i) for o, i in SHAPES]
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for rows in (16, 64, 256, 1024, 2048):
            xs = {i: torch.randn(rows, i) for i in (512, 1408)}
            mkl, dnn = gflops(F.linear, ws, xs, rows), gflops(onednn_linear, ws, xs, rows)
            print(f"thr {threads} M={rows:4d} mkl {mkl:6.1f} onednn {dnn:6.1f} GFLOP/s  "
                  f"onednn/mkl {dnn / mkl:.2f}", flush=True)


if __name__ == "__main__":
    main()
