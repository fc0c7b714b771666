"""This machine's compute and memory limits, measured by the compiled roofline loops
(engine/kernels/roofline.cpp), and the CPU's name and relevant flags."""

from __future__ import annotations

import os
import platform
from typing import Any

# Flags that decide which kernels can run (and so belong next to any speed we state).
RELEVANT_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                  "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8")


def cpu_info() -> dict[str, Any]:
    """{"model_name", "flags" (the relevant ones present), "cpus"} from /proc/cpuinfo."""
    name, flags, cpus = platform.processor(), set(), 0
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name":
                    name, cpus = value.strip(), cpus + 1
                elif key == "flags":
                    flags = set(value.split())
    except OSError:
        pass
    return {"model_name": name, "cpus": cpus,
            "flags": [f for f in RELEVANT_FLAGS if f in flags]}


def machine_limits(threads: list[int], repeats: int, buffer_mib: int,
                   fma_iters: int) -> dict[str, Any]:
    """Per thread count: fp32 FMA GFLOP/s, the clock (GHz, from a dependent-add chain) and the
    vector FMAs retired per cycle, bf16 dot GFLOP/s (None without AVX512-BF16) and
    streaming-read GB/s, each the best of `repeats`."""

    from engine.kernels import compiled

    k = compiled()
    if k is None:
        raise RuntimeError("the compiled CPU kernels are not available: no roofline loops")
    buf = stream_buffer(buffer_mib)
    lanes, chains, out = k.fma_lanes(), k.fma_chains(), {}
    for t in threads:
        fma = min(k.fma_seconds(t, fma_iters) for _ in range(repeats))
        # The clock the FMA loop ran at (one dependent add a cycle), measured right after it.
        clock = min(k.clock_seconds(t, fma_iters) for _ in range(repeats))
        gflops = t * fma_iters * chains * lanes * 2 / fma / 1e9
        ghz = 8 * fma_iters / clock / 1e9 if clock > 0 else None
        entry = {"fma_gflops": round(gflops, 2), "clock_ghz": ghz and round(ghz, 3),
                 # vector FMAs a core retired per cycle: at most the core's FMA issue width
                 # (2 on Zen / Skylake-SP with two FMA pipes)
                 "fma_per_cycle": ghz and round(gflops / (t * ghz * lanes * 2), 3),
                 "bf16_dot_gflops": None}
        if k.has_bf16_dot():
            dot = min(k.bf16_dot_seconds(t, fma_iters) for _ in range(repeats))
            entry["bf16_dot_gflops"] = round(t * fma_iters * 16 * 64 / dot / 1e9, 2)
        entry["read_gbps"] = round(read_gbps(k, buf, t, max(repeats, 5)), 2)
        out[t] = entry
    return {"fma_isa": k.fma_isa(), "fma_lanes": lanes, "fma_chains": chains,
            # what a stand-in for a narrower CPU forced (all three, or a gemm beats the peak)
            "isa_env": {v: os.environ.get(v) for v in (
                "PDSERVE_ISA", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")},
            "bf16_dot": k.has_bf16_dot(),
            "buffer_mib": buffer_mib, "threads": out}


def stream_buffer(mib: int) -> Any:
    """The streaming read's float32 buffer of `mib` MiB (>> L3), written once so every page
    is mapped."""
    import torch

    return torch.ones(mib * (1 << 20) // 4)


def read_gbps(k: Any, buf: Any, threads: int, tries: int) -> float:
    """The streaming read of the float32 tensor `buf` at `threads` threads, GB/s, the best of
    `tries` (k: the compiled kernels)."""
    return buf.numel() * 4 / min(k.read_seconds(buf, threads) for _ in range(tries)) / 1e9


def read_against(limit: dict[str, Any], beside: float | None) -> float:
    """The streaming read a decode fraction is taken against: the higher of the limit's and
    one measured right after the timed steps (roofline_batch's docstring: a VM's bandwidth can
    change within a run)."""
    return max(limit["read_gbps"], beside or 0)


def best_limits(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two machine_limits results merged, the higher of each number kept."""
    merged = {t: {key: (max(v, b["threads"][t][key]) if v is not None else None)
                  for key, v in entry.items()} for t, entry in a["threads"].items()}
    for t, entry in merged.items():  # per cycle from the merged peak and clock
        if entry.get("clock_ghz"):
            entry["fma_per_cycle"] = round(
                entry["fma_gflops"] / (t * entry["clock_ghz"] * a["fma_lanes"] * 2), 3)
    return {**a, "threads": merged}
