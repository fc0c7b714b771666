"""A/B of a decode step with the compiled DecodeStack (engine/kernels/decode_stack.cpp) and
with the Python layers, in one engine, alternating: bench-llama at batch B x 1024 context,
ROUNDS rounds of STEPS steps each way (the order swapped every round), the median step of
each way per round and over all rounds.

usage: python scripts/decode_stack_ab.py DTYPE B THREADS [ROUNDS] [STEPS]
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time

import torch
from decode_step_ab import prefilled  # the same directory

from pdserve.bench.offline import python_layers


def main() -> None:
    dtype, batch, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 6
    steps = int(sys.argv[5]) if len(sys.argv) > 5 else 10
    torch.set_num_threads(threads)
    client = prefilled(dtype, batch, 2 * rounds * (steps + 1) + 8)
    times: dict[str, list[float]] = {"python": [], "stack": []}
    try:
        for r in range(rounds):
            for way in (("python", "stack") if r % 2 == 0 else ("stack", "python")):
                with python_layers() if way == "python" else contextlib.nullcontext():
                    client.get_output()  # one step unmeasured after the switch
                    one = []
                    for _ in range(steps):
                        start = time.perf_counter()
                        out = client.get_output()
                        one.append(time.perf_counter() - start)
                        assert len(out.outputs) == batch
                times[way].append(statistics.median(one))
            print(f"round {r}: python {times['python'][-1] * 1e3:.2f} ms  stack "
                  f"{times['stack'][-1] * 1e3:.2f} ms  "
                  f"stack/python {times['stack'][-1] / times['python'][-1]:.3f}", flush=True)
    finally:
        client.shutdown()
    py, st = statistics.median(times["python"]), statistics.median(times["stack"])
    print(f"{dtype} B={batch} threads={threads}: median step python {py * 1e3:.2f} ms, stack "
          f"{st * 1e3:.2f} ms, stack/python {st / py:.3f}")


if __name__ == "__main__":
    main()
