"""What bounds the KV WRITE between two processes of one host (issue 33 item 4).

UCX moves a push WRITE between two local processes by CMA: ``process_vm_writev`` calls of
512 KiB (``UCX_CMA_SEG_SIZE``), one kernel copy from P's pages into D's. This script times, for
the bytes of a 2048-token bench-llama push (32 MiB, huge-page buffers, one thread):

- ``copy`` — ``torch.Tensor.copy_`` repeated back to back (both buffers stay in the last-level
  cache) and with a 512 MiB read before each copy (the buffers come from DRAM, as a WRITE's do
  once other work has run);
- ``cma`` — ``process_vm_writev`` into a second process, one call and 512 KiB calls, both
  after the same 512 MiB read.

    .venv/bin/python scripts/bench_copy_bound.py [--mib 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _IOV(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _alloc(nbytes: int):
    import torch

    from engine.runner.huge_pages import alloc_kv_cache

    buf = alloc_kv_cache((nbytes // 4,), torch.float32)
    buf.copy_(torch.randn(nbytes // 4))
    return buf


def _holder(conn, nbytes: int) -> None:
    buf = _alloc(nbytes)
    conn.send((os.getpid(), buf.data_ptr()))
    conn.recv()


def _writev(pid: int, src: int, dst: int, nbytes: int, seg: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.process_vm_writev
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IOV), ctypes.c_ulong, ctypes.POINTER(_IOV),
                   ctypes.c_ulong, ctypes.c_ulong]
    for off in range(0, nbytes, seg):
        n = min(seg, nbytes - off)
        done = fn(pid, _IOV(src + off, n), 1, _IOV(dst + off, n), 1, 0)
        if done != n:
            raise OSError(ctypes.get_errno(), "process_vm_writev")


def main() -> int:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    nbytes = args.mib << 20
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    holder = ctx.Process(target=_holder, args=(child, nbytes), daemon=True)
    holder.start()
    pid, remote = conn.recv()
    src, dst, big = _alloc(nbytes), _alloc(nbytes), torch.randn(128 << 20)

    def gbps(fn, flush: bool) -> float:
        fn()
        times = []
        for _ in range(args.iters):
            if flush:
                big.sum()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return round(nbytes / statistics.median(times) / 1e9, 2)

    rounds = []
    for _ in range(args.rounds):
        rounds.append({
            "copy_back_to_back": gbps(lambda: dst.copy_(src), False),
            "copy_from_dram": gbps(lambda: dst.copy_(src), True),
            "cma_one_call_from_dram": gbps(
                lambda: _writev(pid, src.data_ptr(), remote, nbytes, nbytes), True),
            "cma_512k_calls_from_dram": gbps(
                lambda: _writev(pid, src.data_ptr(), remote, nbytes, 512 << 10), True),
        })
        print(json.dumps(rounds[-1]), flush=True)
    conn.send("exit")
    holder.join(10)
    print(json.dumps({"bytes": nbytes, "unit": "GB/s (1e9 bytes/s)", "rounds": rounds}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
