"""A decode step's host time: the step, the compiled DecodeStack's layers, and the rest.

Prefills B random 1024-token prompts (bench-llama, prefix caching off; the skinny rows
threshold measured first, as `pdserve bench roofline` does), then times `steps` full-batch
decode steps and, inside them, the DecodeStack's call (`CausalLM._run_stack`). The rest of
the step is the host's work (scheduler, runner, sampler metadata and the model's Python)
plus the lm_head matmul and the argmax.

usage: [KHASH=<build hash>] [MODEL=<dir>] python scripts/decode_host_time.py DTYPE B THREADS
[STEPS] (from the repo root; KHASH as in decode_step_ab.py: an A/B of two builds; MODEL
another model than bench-llama: .models/tiny-llama's few MiB stay in the caches, its host
work runs on warm caches)
"""

from __future__ import annotations

import os
import sys
import time

import torch
from decode_kernels_ab import load  # the same directory: a build by its hash
from decode_step_ab import prefilled, use_kernels

import engine.kernels.linear as el
import engine.models.causal_lm as cl


def main() -> None:
    dtype, batch, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 40
    if key := os.environ.get("KHASH"):
        use_kernels(load(key))
    torch.set_num_threads(threads)
    el.skinny_rows(getattr(torch, dtype))
    spent = [0.0]
    run_stack = cl.CausalLM._run_stack

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = run_stack(*args, **kwargs)
        spent[0] += time.perf_counter() - start
        return out

    cl.CausalLM._run_stack = timed
    client = prefilled(dtype, batch, steps, model=os.environ.get("MODEL", ".models/bench-llama"))
    spent[0] = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        client.get_output()
    step = (time.perf_counter() - start) / steps * 1e3
    stack = spent[0] / steps * 1e3
    print(f"{dtype} B={batch} threads={threads} step {step:.3f} ms  stack {stack:.3f}  "
          f"rest {step - stack:.3f}")
    client.shutdown()


if __name__ == "__main__":
    main()
