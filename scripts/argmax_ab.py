"""Greedy decoding's argmax: torch.argmax against the compiled argmax_rows
(engine/kernels/argmax.cpp) on a step's float32 logits, alternating in one process, at one
thread and at all of them. Prints the median time of each and their ratio per shape.

    python scripts/argmax_ab.py [REPEATS]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from engine.kernels.argmax import argmax_rows
from pdserve.bench.machine import cpu_info


def _median_s(f, x: torch.Tensor, repeats: int) -> float:
    f(x)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f(x)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    print(cpu_info())
    for threads in sorted({1, torch.get_num_threads()}):
        torch.set_num_threads(threads)
        for vocab in (8192, 49152, 151936):  # bench-llama, SmolLM2, Qwen2
            for rows in (1, 8, 64):
                x = torch.randn(rows, vocab)
                ours = torch_s = 0.0
                for _ in range(3):  # alternating
                    torch_s += _median_s(lambda t: t.argmax(dim=-1), x, repeats)
                    ours += _median_s(argmax_rows, x, repeats)
                print(f"threads {threads} logits [{rows}, {vocab}]: "
                      f"torch {torch_s / 3 * 1e6:8.1f} us  ours {ours / 3 * 1e6:7.1f} us  "
                      f"ratio {ours / torch_s:.3f}")


if __name__ == "__main__":
    main()
