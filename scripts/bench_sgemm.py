"""Every float32 gemm large_linear can choose, on a model's prefill shapes and on large square
ones, interleaved (a loaded machine slows all alike): the compiled sgemm (engine/kernels/
sgemm.cpp), oneDNN's matmul, MKL (F.linear). GFLOP/s from thread CPU time at 1 thread (a
preempted thread's wait is not counted; cache pollution by neighbours still is) and wall time
at more, best of --repeats, and each over the fp32 FMA peak when --peak is given.

    python scripts/bench_sgemm.py --model .models/bench-llama --threads 1,2 \\
        --peak 101.8,202.3 --result-json bench/results/prefill_sgemm_avx2.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

from engine.kernels import linear_kernel
from engine.kernels.linear import ONEDNN, onednn_linear
from pdserve.bench.machine import cpu_info
from pdserve.bench.roofline import prefill_linear_shapes


def gemms() -> dict:
    out = {"mkl": F.linear}
    if ONEDNN:
        out["onednn"] = onednn_linear
    kernel = linear_kernel()
    if kernel is not None and kernel.get_isa() != "scalar":
        out["kernel"] = kernel.sgemm
    return out


def rates(shapes: list[tuple[int, int]], rows: int, repeats: int, clock) -> dict[str, float]:
    fns = gemms()
    seconds = dict.fromkeys(fns, 0.0)
    flop = 0.0
    gen = torch.Generator().manual_seed(0)
    for n, k in shapes:
        x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
        best = dict.fromkeys(fns, float("inf"))
        for fn in fns.values():
            fn(x, w)  # warm
        for _ in range(repeats):
            for name, fn in fns.items():
                start = clock()
                fn(x, w)
                best[name] = min(best[name], clock() - start)
        for name in fns:
            seconds[name] += best[name]
        flop += 2.0 * rows * n * k
    return {name: round(flop / s / 1e9, 2) for name, s in seconds.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--peak", default=None, help="fp32 FMA peak GFLOP/s per thread count")
    p.add_argument("--result-json", default=None)
    args = p.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    peaks = dict(zip(threads, map(float, args.peak.split(",")), strict=True)) if args.peak else {}
    suites = {"model": prefill_linear_shapes(args.model), "square_2048": [(2048, 2048)]}
    result = {"cpu": cpu_info(), "load": os.getloadavg(), "tokens": args.tokens, "runs": {}}
    for t in threads:
        torch.set_num_threads(t)
        clock = time.thread_time if t == 1 else time.perf_counter
        for suite, shapes in suites.items():
            rows = args.tokens if suite == "model" else 2048
            r = rates(shapes, rows, args.repeats, clock)
            if t in peaks:
                r.update({f"{k}_fma_fraction": round(v / peaks[t], 3) for k, v in list(r.items())})
            result["runs"][f"{suite}:{t}"] = r
            print(f"{t} thr {suite:12s} {r}", flush=True)
    result["load_after"] = os.getloadavg()
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
