"""What a host-side torch op costs right after a decode step's kernels, against in a loop.

A decode step streams every weight and every sequence's KV (~130 MB at bench-llama bf16
batch 8 x 1024): the L2 and L3 caches hold none of the interpreter's or torch's working set
afterwards. This times a few ops of the runner's per-step work hot (one after another) and
cold (each after a 64 MiB read), with one torch thread pool of THREADS.

usage: python scripts/host_cold_cost.py [THREADS]
"""

from __future__ import annotations

import array
import sys
import time

import torch


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    flush = torch.ones(16 << 20)  # 64 MiB of float32

    def cold(fn, n: int = 300) -> float:
        total = 0.0
        for _ in range(n):
            flush.sum()
            start = time.perf_counter()
            fn()
            total += time.perf_counter() - start
        return total / n * 1e6

    def hot(fn, n: int = 3000) -> float:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) / n * 1e6

    ids8, ids520 = list(range(8)), list(range(520))
    nested = [ids520[i * 65:(i + 1) * 65] for i in range(8)]
    cache = torch.empty(600, 8, 2, 16, 4, 64, dtype=torch.bfloat16)
    logits = torch.randn(8, 8192).bfloat16()
    cases = {
        "nothing": lambda: None,
        "torch.tensor of 8 ints": lambda: torch.tensor(ids8, dtype=torch.long),
        "torch.tensor of 8 x 65 nested": lambda: torch.tensor(nested, dtype=torch.long),
        "frombuffer of an int64 array(520)": lambda: torch.frombuffer(
            array.array("q", ids520), dtype=torch.long),
        "a view": lambda: cache.view(-1, 256),
        "x[list of 8]": lambda: logits[ids8],
        "bf16 [8, 8192] .float()": lambda: logits.float(),
        "torch.empty(8, 512)": lambda: torch.empty(8, 512),
        "200 dict lookups (Python)": lambda: [{}.get(i) for i in range(200)],
    }
    for name, fn in cases.items():
        print(f"{name:36s} hot {hot(fn):7.2f} us   cold {cold(fn):7.2f} us")


if __name__ == "__main__":
    main()
