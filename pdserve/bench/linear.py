"""`pdserve bench linear`: the model's matmuls at decode batch sizes, F.linear vs our kernel.

For each row count, one "step" multiplies that many random rows by every weight matrix of the
model (its own shapes, distinct random weights per layer, so the weights come from memory as
in a real step, plus the LM head); the two paths alternate step by step and the medians are
compared. The ratio is kernel / F.linear time (below 1: the kernel is faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="local Hugging Face model directory")
    parser.add_argument("--rows", default="1,2,4,8,16,24,32,64",
                        help="comma-separated row counts (decode batch sizes)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--result-json", default=None)


def _shapes(model: str) -> list[tuple[int, int]]:
    from engine.models import load_arch

    a = load_arch(model)
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    layer = [(q + 2 * kv, a.hidden_size), (a.hidden_size, q),
             (2 * a.intermediate_size, a.hidden_size), (a.hidden_size, a.intermediate_size)]
    return layer * a.num_layers + [(a.vocab_size, a.hidden_size)]


def main(args: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F

    from engine.kernels import linear_kernel

    if args.threads:
        torch.set_num_threads(args.threads)
    kernel = linear_kernel()
    if kernel is None:
        print("the skinny_linear kernel is not available on this machine")
        return 1
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) for n, k in _shapes(args.model)]
    result: dict[str, Any] = {"model": args.model, "threads": torch.get_num_threads(),
                              "rows": {}}
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=gen) for k in {w.shape[1] for w in weights}}
        paths = {"torch": F.linear, "kernel": kernel.skinny_linear}
        for w in weights:
            ref = F.linear(xs[w.shape[1]], w)
            torch.testing.assert_close(kernel.skinny_linear(xs[w.shape[1]], w), ref,
                                       rtol=1e-4, atol=1e-3)
        times: dict[str, list[float]] = {p: [] for p in paths}
        for _ in range(args.repeats):
            for name, fn in paths.items():
                start = time.perf_counter()
                for w in weights:
                    fn(xs[w.shape[1]], w)
                times[name].append((time.perf_counter() - start) * 1e3)
        med = {p: statistics.median(t) for p, t in times.items()}
        result["rows"][m] = {"torch_ms": round(med["torch"], 2),
                             "kernel_ms": round(med["kernel"], 2),
                             "ratio": round(med["kernel"] / med["torch"], 3)}
        print(f"rows {m:4d}: F.linear {med['torch']:7.2f} ms  kernel {med['kernel']:7.2f} ms"
              f"  ratio {med['kernel'] / med['torch']:.2f}", flush=True)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
