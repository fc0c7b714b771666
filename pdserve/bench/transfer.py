"""`pdserve bench transfer`: push-mode KV transfer bandwidth between two real processes.

D and P each hold a KV cache shaped for the model (``config.json``: layers, KV heads, head dim;
float32, layout [num_blocks, layers, 2, block_size, kv_heads, head_dim]) in their own spawned
process, with a NIXL agent (progress thread off) and a side channel. Per iteration, as in the
real push flow: D sends ``PUSH_REG`` for ceil(N / block_size) blocks, P (which handshakes with D
through D's side channel on the first registration) WRITEs its blocks into D's with the
completion notification, and D waits for that completion. Both sides poll while waiting.

Reported (JSON, docs/design.md §3): ``bytes`` per transfer, ``descriptors`` per transfer, ``gbps``
(bytes / median WRITE time on P, submit -> DONE, in GB/s = 1e9 bytes/s), ``memcpy_gbps``
(P's single-thread ``torch.Tensor.copy_`` of the blocks it writes into a buffer like D's, one
copy an iteration, before the WRITE and after it in turn: the copy and the WRITE then find the
caches and the machine alike; on a shared 2-core guest either alone swings by half between
runs), ``memcpy_back_to_back_gbps`` (the same copy repeated back to back, its bytes left in
the last-level cache: what the WRITE is not compared with) and
``ratio = gbps / memcpy_gbps``; plus end-to-end figures (D: PUSH_REG sent -> completion seen)
and ``verified`` (D's blocks equal P's, compared by per-block checksums).

``--split-heads`` measures what heterogeneous TP costs (docs/design.md §8): P holds half the
KV heads (a TP=2 rank 0) and WRITEs them into a D holding all of them (TP=1), as
``layers·2·block_size`` runs per block built for each transfer; the baseline, in the same run,
WRITEs the same bytes as whole blocks (P and D both holding that half, prepped descriptors).
Reported: the split run's keys, plus ``whole_*`` for the baseline and
``split_over_whole_write_time`` (median WRITE time, split / whole).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

HOST = "127.0.0.1"


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="local Hugging Face model directory")
    parser.add_argument("--num-tokens", type=int, required=True, help="prompt tokens to move")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layout", choices=("contiguous", "scattered"), default="contiguous",
                        help="D's block ids: one run, or every other block (one descriptor each)")
    parser.add_argument("--backends", default="UCX", help="comma-separated NIXL backends")
    parser.add_argument("--no-huge-pages", action="store_true",
                        help="plain 4 KiB-page caches instead of the engine's huge-page ones")
    parser.add_argument("--split-heads", action="store_true",
                        help="P holds half the KV heads and writes them into a D holding all "
                             "(per-run descriptors), vs the same bytes as whole blocks")
    parser.add_argument("--result-json", default=None)


@dataclass(frozen=True)
class Shape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    def cache_shape(self, num_blocks: int, heads: int) -> tuple[int, ...]:
        return (num_blocks, self.num_layers, 2, self.block_size, heads, self.head_dim)

    def layout(self, heads: int) -> Any:
        """A rank holding the first `heads` of the model's KV heads (float32)."""
        from kvconnector.tp_layout import HeadLayout

        return HeadLayout(self.num_layers, self.block_size, heads, 0, self.num_kv_heads,
                          self.head_dim, 4)


def model_shape(model_dir: str, block_size: int) -> Shape:
    if not os.path.isdir(model_dir):  # a .gguf file or an alias: its metadata
        from engine.models import load_arch
        from engine.models.source import resolve_model

        a = load_arch(resolve_model(model_dir))
        return Shape(a.num_layers, a.num_kv_heads, a.head_dim, block_size)
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return Shape(cfg["num_hidden_layers"], cfg.get("num_key_value_heads") or heads, head_dim,
                 block_size)


def _compat(shape: Shape) -> str:
    from kvconnector.handshake import compat_hash

    return compat_hash("bench", "float32", shape.num_layers, shape.num_kv_heads, shape.head_dim,
                       shape.block_size, "push")


def _setup(name: str, shape: Shape, num_blocks: int, backends: list[str],
           huge_pages: bool, heads: int) -> tuple:
    import torch

    from kvconnector.handshake import SideChannelServer
    from kvconnector.nixl import NixlTransport

    seed = torch.Generator().manual_seed(ord(name[0]))  # P and D hold different data
    dims = shape.cache_shape(num_blocks, heads)
    cache = _alloc(dims, huge_pages)
    cache.copy_(torch.randn(dims, generator=seed))
    layout = shape.layout(heads)
    transport = NixlTransport(name, cache, layout.bytes_per_block, backends,
                              engine_id=f"bench-{name}", block_size=shape.block_size,
                              compat_hash=_compat(shape), layout=layout,
                              tp_size=shape.num_kv_heads // heads)
    server = SideChannelServer(HOST, 0, transport.local_metadata).start()
    return cache, transport, server


def _alloc(dims: tuple[int, ...], huge_pages: bool) -> Any:
    import torch

    from engine.runner.huge_pages import alloc_kv_cache

    if huge_pages:  # as the engine allocates its cache
        return alloc_kv_cache(dims, torch.float32)
    return torch.zeros(dims)


def _copy_times(dst: Any, src: Any, n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return times


def _checksums(cache: Any, ids: list[int], heads: int) -> list[float]:
    """Per block, over the first `heads` KV heads (those P holds and writes)."""
    return cache[ids][..., :heads, :].flatten(1).double().sum(1).tolist()


def _run_prefill(conn: Any, shape: Shape, ids: list[int], total: int, backends: list[str],
                 huge_pages: bool, heads: tuple[int, int]) -> None:
    import torch

    from kvconnector import wire
    from kvconnector.handshake import fetch_peer_metadata

    torch.set_num_threads(1)
    cache, transport, server = _setup("P", shape, len(ids) + 1, backends, huge_pages,
                                      heads[0])
    src = cache[ids[0]:ids[-1] + 1]  # P's ids are one run
    scratch = _alloc(src.shape, huge_pages)
    warm = _copy_times(scratch, src, 10)  # back to back: both buffers stay in cache
    conn.send(server.port)
    times, copies, descriptors, done = [], [], 0, 0
    while done < total:
        for _, raw in transport.get_new_notifs():
            reg = wire.decode_notif(raw)
            if not isinstance(reg, wire.PushReg):
                continue
            if "D" not in transport.peers():
                transport.add_peer(fetch_peer_metadata(reg.decode_host, reg.decode_port,
                                                       _compat(shape), 10.0))
            if done % 2 == 0:  # the copy before the WRITE and after it, in turn
                copies += _copy_times(scratch, src, 1)
            start = time.perf_counter()
            handle = transport.write("D", ids, reg.local_block_ids[0],
                                     wire.encode_completion(reg.request_id, 1))
            while (state := transport.check(handle)) == "PROC":
                pass
            times.append(time.perf_counter() - start)
            if state != "DONE":
                raise RuntimeError(f"bench WRITE for {reg.request_id} ended {state}")
            descriptors = handle.descriptors
            transport.release(handle)
            if done % 2:
                copies += _copy_times(scratch, src, 1)
            done += 1
    conn.send((times, copies, warm, descriptors, _checksums(cache, ids, heads[0])))
    conn.recv()  # keep the agent alive until D has read everything
    _exit(server, transport)


def _run_decode(conn: Any, shape: Shape, ids: list[int], total: int, backends: list[str],
                huge_pages: bool, heads: tuple[int, int]) -> None:
    import secrets

    from kvconnector import wire
    from kvconnector.handshake import fetch_peer_metadata

    cache, transport, server = _setup("D", shape, max(ids) + 1, backends, huge_pages,
                                      heads[1])
    p_port = conn.recv()
    transport.add_peer(fetch_peer_metadata(HOST, p_port, _compat(shape), 10.0))
    times = []
    for i in range(total):
        req_id = f"bench-{i}-{secrets.token_hex(4)}"
        reg = wire.PushReg(req_id, f"tx-{i}", "bench-D", HOST, server.port, 1, [ids], 0,
                           "bench-P", HOST, p_port, 1)
        start = time.perf_counter()
        transport.send_notif("P", wire.encode_push_reg(reg))
        deadline = time.monotonic() + 60
        while not any(wire.decode_notif(m) == wire.Completion(req_id, 1)
                      for _, m in transport.get_new_notifs()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no completion for {req_id} within 60 s")
        times.append(time.perf_counter() - start)
    conn.send((times, _checksums(cache, ids, heads[0])))
    conn.recv()
    _exit(server, transport)


def _exit(server: Any, transport: Any) -> None:
    """Tear down, then skip the interpreter's slow teardown of torch and the NIXL plugins."""
    server.stop()
    transport.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(model: str, num_tokens: int, block_size: int = 16, iters: int = 10, warmup: int = 2,
        layout: str = "contiguous", backends: tuple[str, ...] = ("UCX",),
        huge_pages: bool = True, split_heads: bool = False) -> dict[str, Any]:
    if num_tokens < 1 or iters < 1 or warmup < 0:
        raise ValueError("need --num-tokens >= 1, --iters >= 1, --warmup >= 0")
    shape = model_shape(model, block_size)
    h = shape.num_kv_heads
    if not split_heads:
        return _measure(shape, num_tokens, iters, warmup, layout, backends, huge_pages, (h, h))
    if h % 2:
        raise ValueError(f"--split-heads needs an even number of KV heads, the model has {h}")
    whole = _measure(shape, num_tokens, iters, warmup, layout, backends, huge_pages,
                     (h // 2, h // 2))
    split = _measure(shape, num_tokens, iters, warmup, layout, backends, huge_pages,
                     (h // 2, h))
    return {**split, **{f"whole_{k}": whole[k] for k in (
                "descriptors", "gbps", "write_ms_median", "write_ms_p99", "verified")},
            "split_over_whole_write_time": _sig(split["write_ms_median"]
                                                / whole["write_ms_median"]),
            "verified": split["verified"] and whole["verified"]}


def _measure(shape: Shape, num_tokens: int, iters: int, warmup: int, layout: str,
             backends: tuple[str, ...], huge_pages: bool, heads: tuple[int, int]
             ) -> dict[str, Any]:
    """One P/D pair: P holds the model's first heads[0] KV heads, D its first heads[1]."""
    block_size = shape.block_size
    nblocks = math.ceil(num_tokens / block_size)
    p_ids = list(range(nblocks))
    d_ids = [1 + i for i in p_ids] if layout == "contiguous" else [2 * i + 1 for i in p_ids]
    total = warmup + iters
    ctx = mp.get_context("spawn")
    p_conn, p_child = ctx.Pipe()
    d_conn, d_child = ctx.Pipe()
    procs = [ctx.Process(target=_run_prefill, args=(p_child, shape, p_ids, total, list(backends),
                                                         huge_pages, heads),
                         name="bench-transfer-P", daemon=True),
             ctx.Process(target=_run_decode, args=(d_child, shape, d_ids, total, list(backends),
                                                        huge_pages, heads),
                         name="bench-transfer-D", daemon=True)]
    for proc in procs:
        proc.start()
    try:
        d_conn.send(_recv(p_conn, procs, 120))
        p_times, p_copies, p_warm, descriptors, p_sums = _recv(p_conn, procs, 600)
        d_times, d_sums = _recv(d_conn, procs, 600)
        for conn in (p_conn, d_conn):
            conn.send("exit")
        for proc in procs:
            proc.join(30)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
    nbytes = nblocks * shape.layout(min(heads)).bytes_per_block
    write_s = statistics.median(p_times[warmup:])
    e2e_s = statistics.median(d_times[warmup:])
    gbps = nbytes / write_s / 1e9
    mem = nbytes / statistics.median(p_copies[warmup:]) / 1e9
    return {
        "bytes": nbytes, "descriptors": descriptors, "gbps": _sig(gbps),
        "memcpy_gbps": _sig(mem), "ratio": _sig(gbps / mem),
        "memcpy_back_to_back_gbps": _sig(nbytes / statistics.median(p_warm[1:]) / 1e9),
        "e2e_gbps": _sig(nbytes / e2e_s / 1e9),
        "write_ms_median": _sig(write_s * 1e3),
        "write_ms_p99": _sig(_pct(p_times[warmup:], 0.99) * 1e3),
        "e2e_ms_median": _sig(e2e_s * 1e3),
        "num_blocks": nblocks, "bytes_per_block": shape.layout(heads[0]).bytes_per_block,
        "iters": iters, "kv_heads": {"P": heads[0], "D": heads[1]},
        "layout": layout, "huge_pages": huge_pages, "shape": asdict(shape),
        "unit": "GB/s (1e9 bytes/s)",
        "ucx_tls": os.environ.get("UCX_TLS", "(default)"), "verified": p_sums == d_sums,
    }


def _recv(conn: Any, procs: list, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while not conn.poll(0.2):
        dead = [p.name for p in procs if not p.is_alive()]
        if dead:
            raise RuntimeError(f"bench process {', '.join(dead)} died (see its traceback above)")
        if time.monotonic() > deadline:
            raise TimeoutError(f"bench processes did not report within {timeout:.0f} s")
    return conn.recv()


def _sig(value: float) -> float:
    return float(f"{value:.6g}")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(args: argparse.Namespace) -> int:
    result = run(args.model, args.num_tokens, args.block_size, args.iters, args.warmup,
                 args.layout, tuple(b for b in args.backends.split(",") if b),
                 not args.no_huge_pages, args.split_heads)
    text = json.dumps(result, indent=2)
    print(text)
    if args.result_json:
        with open(args.result_json, "w") as f:
            f.write(text + "\n")
    return 0 if result["verified"] else 1
