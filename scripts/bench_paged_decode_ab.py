"""A/B of the paged decode kernel alone: two (or more) copies of paged_attention.cpp (each a
directory holding it with simd.h and isa.h) built as small modules side by side, run in turn
over the same KV cache (the bench model's shape: 8 layers, 4 kv heads, 8 query heads, head_dim
64, 16-token blocks, huge pages as the engine allocates it), every layer once per timing,
alternating with a streaming read (torch's sum) of the same bytes; best of --reps each.

    .venv/bin/python scripts/bench_paged_decode_ab.py \
        --trees base=/tmp/old_kernels,new=engine/kernels --batch 8 --dtype float32
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from engine.kernels import _CFLAGS, load_or_build
from engine.runner.huge_pages import alloc_kv_cache

_BIND = r"""
#include <torch/extension.h>
#include "isa.h"
void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor chunks, torch::Tensor table,
                  torch::Tensor rows, torch::Tensor ctx_lens, int64_t layer, double scale);
Isa current_isa() { return kBestIsa; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode); }
"""


def _module(tag: str, src: Path, work: Path):
    d = work / tag
    d.mkdir()
    for n in ("paged_attention.cpp", "simd.h", "isa.h"):
        shutil.copy(src / n, d / n)
    (d / "bind.cpp").write_text(_BIND)
    return load_or_build(f"attn_ab_{tag}", [d / "paged_attention.cpp", d / "bind.cpp"], _CFLAGS,
                         [d / "simd.h", d / "isa.h"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", required=True, help="tag=dir,tag=dir (dirs with the sources)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--ctx", type=int, default=1024, help="a multiple of 16")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=11)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    layers, kv, dim, heads, bs = 8, 4, 64, 8, 16
    nblk = a.ctx // bs
    shape = (a.batch * nblk, layers, 2, bs, kv, dim)
    cache = alloc_kv_cache(shape, getattr(torch, a.dtype))
    cache.copy_(torch.randn(shape))
    view = cache.view(-1, bs, kv, dim)
    table = (torch.arange(a.batch * nblk).view(a.batch, nblk) * 2 * layers).contiguous()
    rows, ctx = torch.arange(a.batch), torch.full((a.batch,), nblk * bs)
    q = torch.randn(a.batch, heads, dim)
    nbytes = cache.numel() * cache.element_size()
    buf = torch.ones(nbytes // 4)
    with tempfile.TemporaryDirectory() as work:
        mods = {t: _module(t, Path(s), Path(work))
                for t, s in (x.split("=") for x in a.trees.split(","))}
    best = {t: float("inf") for t in [*mods, "read"]}
    outs = {}
    for _ in range(a.reps):
        for t, m in mods.items():
            out = torch.empty_like(q)
            start = time.perf_counter()
            for layer in range(layers):
                m.paged_decode(out, q, view, table, rows, ctx, layer, dim ** -0.5)
            best[t] = min(best[t], time.perf_counter() - start)
            outs[t] = out
        start = time.perf_counter()
        buf.sum()
        best["read"] = min(best["read"], time.perf_counter() - start)
    first = next(iter(outs.values()))
    print(f"{a.dtype} batch {a.batch} x {nblk * bs} ctx, {a.threads} thr, KV {nbytes >> 20} MiB;"
          f" max |diff| to {next(iter(outs))}: "
          + ", ".join(f"{t} {(o - first).abs().max().item():.1e}" for t, o in outs.items()))
    for t, s in best.items():
        print(f"  {t:8s} {s * 1e3:8.2f} ms  {nbytes / s / 1e9:6.2f} GB/s  "
              f"{best['read'] / s:.2f} of the streaming read")


if __name__ == "__main__":
    main()
