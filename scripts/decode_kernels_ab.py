"""A/B of two builds of the compiled kernels in one process, interleaved: paged_decode at
batch 1/8/32 x 1024 context (bench-llama's attention shapes, blocks in random order, the
cache on huge pages as the engine allocates it), skinny_linear on bench-llama's weights (on
huge pages too, as the engine's) and prefill_attention over 1024 fresh tokens (8 layers of
bench-llama's heads), fp32 and bf16; best of 3 x 9 runs each, thread CPU time at 1 thread
(a loaded machine's run-queue waits left out), wall time at more.

usage: python scripts/decode_kernels_ab.py OLD_HASH NEW_HASH THREADS paged,skinny,prefill [ISA]
(two builds under ~/.cache/pdserve/kernels/pdserve_kernels_<hash>.so; ISA: the path both run,
as PDSERVE_ISA names it). AB_WEIGHT_COPIES=N runs skinny over N copies of the weights (4: more
than a 260 MiB L3 holds, so they come from DRAM as a loaded server's would). AB_PEAK=X scales
prefill's queries by X (20: scores ~20 wide, a peaked softmax whose tiny weights give denormal
products). AB_SHAPES=OxI,... runs skinny on each [out, in] weight shape apart instead (copies
of it filling ~96 MiB in float32, ~48 in bf16, on huge pages), at 2-64 rows of x: real
models' long rows of x (K = 1408-4096) against bench-llama's short ones.
Prints GB/s (GFLOP/s for prefill) of each and NEW/OLD; skinny
outputs must be equal, the attentions' close (max difference printed).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import torch

from engine.runner.huge_pages import alloc_kv_cache

SHAPES = [(1024, 512), (512, 512), (2816, 512), (512, 1408)]  # one layer's, [out, in]


def load(key: str):
    name = f"pdserve_kernels_{key}"
    path = Path.home() / ".cache" / "pdserve" / "kernels" / f"{name}.so"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def best(fn, clock, n: int = 9) -> float:
    out = float("inf")
    for _ in range(n):
        start = clock()
        fn()
        out = min(out, clock() - start)
    return out


def ab(label: str, nbytes: float, fa, fb, clock, extra: str = "", unit: str = "GB/s") -> None:
    ta = tb = float("inf")
    for _ in range(3):  # interleaved
        ta, tb = min(ta, best(fa, clock)), min(tb, best(fb, clock))
    print(f"{label}: old {nbytes / ta / 1e9:6.2f} {unit}  new {nbytes / tb / 1e9:6.2f} {unit}  "
          f"new/old {ta / tb:.3f} {extra}", flush=True)


def _huge(w: torch.Tensor) -> torch.Tensor:
    """w copied onto huge pages, as the engine holds its weights (on 4 KiB pages a streamed
    weight costs a TLB walk every 4 KiB)."""
    out = alloc_kv_cache(tuple(w.shape), w.dtype)
    return out.copy_(w)


def skinny(a, b, dt, clock) -> None:
    copies = int(os.environ.get("AB_WEIGHT_COPIES", "1"))
    ws = [_huge(torch.randn(o, i).to(dt)) for _ in range(8 * copies) for o, i in SHAPES]
    ws.append(_huge(torch.randn(8192, 512).to(dt)))
    nbytes = sum(w.numel() * w.element_size() for w in ws)
    for m in (1, 2, 3, 4, 8, 32):
        xs = {i: torch.randn(m, i).to(dt) for i in (512, 1408)}
        for w in ws:
            x = xs[w.shape[1]]
            assert torch.equal(a.skinny_linear(x, w), b.skinny_linear(x, w))

        def run(k, xs=xs):
            return lambda: [k.skinny_linear(xs[w.shape[1]], w) for w in ws]

        ab(f"skinny {str(dt)[6:]:8s} M={m:2d}", nbytes, run(a), run(b), clock)


def skinny_shapes(a, b, dt, clock, shapes: str) -> None:
    for o, i in (tuple(int(v) for v in shape.split("x")) for shape in shapes.split(",")):
        ws = [_huge(torch.randn(o, i).to(dt)) for _ in range(max(1, (96 << 20) // (o * i * 4)))]
        nbytes = sum(w.numel() * w.element_size() for w in ws)
        for m in (2, 4, 8, 16, 32, 64):
            x = torch.randn(m, i).to(dt)
            assert torch.equal(a.skinny_linear(x, ws[0]), b.skinny_linear(x, ws[0]))

            def run(k, x=x, ws=ws):
                return lambda: [k.skinny_linear(x, w) for w in ws]

            ab(f"skinny {str(dt)[6:]:8s} {o}x{i} M={m:2d}", nbytes, run(a), run(b), clock)


def paged(a, b, dt, clock) -> None:
    layers, bs, kv, dim, heads, ctx = 8, 16, 4, 64, 8, 1024
    for batch in (1, 8, 32):
        nblk = ctx // bs
        cache = alloc_kv_cache((batch * nblk + 1, layers, 2, bs, kv, dim), dt)  # as the engine
        cache.copy_(torch.randn(cache.shape))
        view = cache.view(-1, bs, kv, dim)
        table = (torch.randperm(batch * nblk).view(batch, nblk) * (2 * layers)).contiguous()
        rows, lens = torch.arange(batch), torch.full((batch,), ctx)
        q = torch.randn(batch, heads, dim)
        oa, ob = torch.empty(batch, heads, dim), torch.empty(batch, heads, dim)

        def run(k, out, view=view, table=table, rows=rows, lens=lens, q=q):
            return lambda: [k.paged_decode(out, q, view, table, rows, lens, layer, 0.125)
                            for layer in range(layers)]

        run(a, oa)()
        run(b, ob)()
        nbytes = batch * ctx * layers * 2 * kv * dim * cache.element_size()
        ab(f"paged  {str(dt)[6:]:8s} B={batch:2d}", nbytes, run(a, oa), run(b, ob), clock,
           f"maxdiff {(oa - ob).abs().max().item():.2e}")


def prefill(a, b, dt, clock) -> None:
    layers, tokens, heads, kv, dim = 8, 1024, 8, 4, 64
    peak = float(os.environ.get("AB_PEAK", "1"))
    qkv = [((torch.randn(tokens, heads, dim) * peak).to(dt), torch.randn(tokens, kv, dim).to(dt),
            torch.randn(tokens, kv, dim).to(dt)) for _ in range(layers)]
    oa, ob = torch.empty(tokens, heads, dim), torch.empty(tokens, heads, dim)

    def run(k, out):
        return lambda: [k.prefill_attention(out, q, kk, v, 0.125) for q, kk, v in qkv]

    run(a, oa)()
    run(b, ob)()
    flop = 2 * layers * heads * dim * tokens * (tokens + 1)  # Q K^T and P V, causal
    ab(f"prefill {str(dt)[6:]:8s} T={tokens}", flop, run(a, oa), run(b, ob), clock,
       f"maxdiff {(oa - ob).abs().max().item():.2e}", "GFLOP/s")


def main() -> None:
    a, b = load(sys.argv[1]), load(sys.argv[2])
    torch.set_num_threads(int(sys.argv[3]))
    what = sys.argv[4].split(",")
    if len(sys.argv) > 5:
        a.set_isa(sys.argv[5])
        b.set_isa(sys.argv[5])
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    buf = torch.ones(256 << 18)
    t = best(lambda: a.read_seconds(buf, torch.get_num_threads()), clock, 5)
    print(f"stream read {buf.numel() * 4 / t / 1e9:.2f} GB/s", flush=True)
    for dt in (torch.float32, torch.bfloat16):
        if "skinny" in what and os.environ.get("AB_SHAPES"):
            skinny_shapes(a, b, dt, clock, os.environ["AB_SHAPES"])
        elif "skinny" in what:
            skinny(a, b, dt, clock)
        if "paged" in what:
            paged(a, b, dt, clock)
        if "prefill" in what:
            prefill(a, b, dt, clock)


if __name__ == "__main__":
    main()
