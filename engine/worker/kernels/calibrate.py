"""Measured dispatch threshold of the skinny_linear kernel: up to how many rows it beats the gemm
`linear` uses beyond it (engine/models/linear.py `large_linear`: oneDNN for float32, F.linear
for bf16).

The crossover depends on the CPU (vector width, bf16 dot instructions, cache sizes), on the
kernel's path (PDSERVE_ISA), on the dtype and on the thread count, so it is measured, not
fixed: at the first use for a (dtype, threads, path) on this machine, one weight of
CALIBRATION_SHAPE (larger than a core's L2, as the model's weights are) is multiplied by
1, 2, 4, ... 128 random rows, kernel and that gemm alternating, best of REPEATS each; the
threshold is the largest row count at which the kernel is not slower, 0 if it never wins.
The result (well under a second to measure) is stored beside the kernels' shared object
(`<name>.thresholds.json`, keyed "dtype:threads:path"), so each machine measures once;
`python -m engine.worker.kernels --recalibrate` measures again (e.g. on a quiet machine).

Which float32 gemm `large_linear` runs is measured the same way, once per thread count:
oneDNN's matmul against F.linear (MKL's sgemm) on GEMM_ROWS rows of the same weight, best of
REPEATS each; oneDNN where it is not slower (key "float32:threads:onednn").
"""

from __future__ import annotations

import functools
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

CALIBRATION_SHAPE = (4096, 1024)  # [out, in]: 16 MiB in float32, 8 MiB in bf16
ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
GEMM_ROWS = 256  # a prefill chunk's rows, well past every skinny threshold
REPEATS = 5


def _store() -> Path:
    from engine.worker.kernels import cached_path

    name, so = cached_path()
    return so.with_name(f"{name}.thresholds.json")


def _load() -> dict[str, int]:
    try:
        return json.loads(_store().read_text())
    except (OSError, ValueError):
        return {}


def _save(key: str, rows: int) -> None:
    path = _store()
    table = {**_load(), key: rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".thresholds-")
    with os.fdopen(fd, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def _seconds(fn, x: torch.Tensor, w: torch.Tensor) -> float:
    start = time.perf_counter()
    fn(x, w)
    return time.perf_counter() - start


def measure(kernel, dtype: torch.dtype) -> int:
    """Largest row count in ROWS where kernel.skinny_linear is not slower than the gemm."""
    from engine.models.linear import large_linear

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(*CALIBRATION_SHAPE, generator=gen).to(dtype)
    best = 0
    for m in ROWS:
        x = torch.randn(m, w.shape[1], generator=gen).to(dtype)
        kernel.skinny_linear(x, w), large_linear(x, w)  # warm both
        k = t = float("inf")
        for _ in range(REPEATS):
            k = min(k, _seconds(kernel.skinny_linear, x, w))
            t = min(t, _seconds(large_linear, x, w))
        if k <= t:
            best = m
    return best


def measure_gemm(onednn: Callable[..., Any], mkl: Callable[..., Any]) -> bool:
    """Whether `onednn` is not slower than `mkl` on [GEMM_ROWS, in] x CALIBRATION_SHAPE^T."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(*CALIBRATION_SHAPE, generator=gen)
    x = torch.randn(GEMM_ROWS, w.shape[1], generator=gen)
    onednn(x, w), mkl(x, w)  # warm both
    a = b = float("inf")
    for _ in range(REPEATS):
        a = min(a, _seconds(onednn, x, w))
        b = min(b, _seconds(mkl, x, w))
    return a <= b


@functools.cache
def onednn_sgemm(threads: int) -> bool:
    """Whether float32 gemms beyond the skinny rows go to oneDNN at this thread count (else
    F.linear): measured once per machine, then read from the store."""
    from engine.models.linear import onednn_linear

    key = f"float32:{threads}:onednn"
    table = _load()
    if key in table:
        return bool(table[key])
    wins = measure_gemm(onednn_linear, F.linear)
    logger.info("float32 gemm at %d threads: %s (measured)", threads,
                "oneDNN" if wins else "F.linear")
    _save(key, int(wins))
    return wins


def _key(dtype: torch.dtype, threads: int, isa: str) -> str:
    # ":gemm2": measured against large_linear (keys without it were against F.linear)
    return f"{str(dtype).removeprefix('torch.')}:{threads}:{isa}:gemm2"


@functools.cache
def _threshold(dtype: torch.dtype, threads: int, isa: str) -> int:
    from engine.worker.kernels import linear_kernel

    key = _key(dtype, threads, isa)
    table = _load()
    if key in table:
        return int(table[key])
    rows = measure(linear_kernel(), dtype)
    logger.info("skinny_linear threshold %s: %d rows (measured)", key, rows)
    _save(key, rows)
    return rows


def skinny_rows(dtype: torch.dtype) -> int:
    """Up to how many rows `linear` should use the kernel for this dtype, thread count and path
    (0: never). Measured once per machine, then read from the store."""
    from engine.worker.kernels import linear_kernel

    kernel = linear_kernel()
    if kernel is None or dtype not in (torch.float32, torch.bfloat16):
        return 0
    return _threshold(dtype, torch.get_num_threads(), kernel.get_isa())


def recalibrate() -> dict[str, int]:
    """Measure both dtypes again at this process's thread count and path, replacing what the
    store holds for them."""
    from engine.models.linear import ONEDNN, onednn_linear
    from engine.worker.kernels import linear_kernel

    kernel = linear_kernel()
    if kernel is None:
        return {}
    _threshold.cache_clear()
    onednn_sgemm.cache_clear()
    threads = torch.get_num_threads()
    out = {}
    if ONEDNN:
        out["float32_onednn"] = int(measure_gemm(onednn_linear, F.linear))
        _save(f"float32:{threads}:onednn", out["float32_onednn"])
    for dtype in (torch.float32, torch.bfloat16):
        rows = measure(kernel, dtype)
        _save(_key(dtype, torch.get_num_threads(), kernel.get_isa()), rows)
        out[str(dtype).removeprefix("torch.")] = rows
    return out
