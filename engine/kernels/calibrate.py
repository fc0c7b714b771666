"""Measured dispatch thresholds of the skinny_linear kernel: up to how many rows it beats the gemm
`linear` uses beyond it (engine/kernels/linear.py `large_linear`: oneDNN for float32, F.linear
for bf16).

The crossover depends on the CPU (vector width, bf16 dot instructions, cache sizes), on the
kernel's path (PDSERVE_ISA), on the dtype and on the thread count, so it is measured, not
fixed: at the first use for a (dtype, threads, path) on this machine, one weight of
CALIBRATION_SHAPE (larger than a core's L2, as the model's weights are) is multiplied by
1, 2, 4, ... 128 random rows, kernel and that gemm alternating, best of REPEATS each; the
threshold is the largest row count at which the kernel is not slower, 0 if it never wins.
The result (well under a second to measure) is stored beside the kernels' shared object
(`<name>.thresholds.json`, keyed "dtype:threads:path"), so each machine measures once;
`python -m engine.kernels --recalibrate` measures again (e.g. on a quiet machine).

Which float32 gemm `large_linear` runs is measured the same way, once per thread count:
oneDNN's matmul against F.linear (MKL's sgemm) on GEMM_ROWS rows of the same weight, best of
REPEATS each; oneDNN where it is not slower (key "float32:threads:onednn"). And the compiled
sgemm (engine/kernels/sgemm.cpp) against that choice, once per thread count and kernel path
(key "float32:threads:path:sgemm"): the compiled one where it is not slower.

This module measures and stores; it is handed the gemms it times (the dispatch in linear.py
passes its own), so it imports nothing above the kernels' build.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.kernels import cached_path

logger = logging.getLogger(__name__)

CALIBRATION_SHAPE = (4096, 1024)  # [out, in]: 16 MiB in float32, 8 MiB in bf16
ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
GEMM_ROWS = 256  # a prefill chunk's rows, well past every skinny threshold
REPEATS = 5

Gemm = Callable[[torch.Tensor, torch.Tensor], Any]


def _store() -> Path:
    name, so = cached_path()
    return so.with_name(f"{name}.thresholds.json")


def _load() -> dict[str, int]:
    try:
        return json.loads(_store().read_text())
    except (OSError, ValueError):
        return {}


def save(key: str, rows: int) -> None:
    """Store `rows` under `key`, replacing what the store held for it."""
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


def measure(kernel, dtype: torch.dtype, gemm: Gemm) -> int:
    """Largest row count in ROWS where kernel.skinny_linear is not slower than `gemm`."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(*CALIBRATION_SHAPE, generator=gen).to(dtype)
    best = 0
    for m in ROWS:
        x = torch.randn(m, w.shape[1], generator=gen).to(dtype)
        kernel.skinny_linear(x, w), gemm(x, w)  # warm both
        k = t = float("inf")
        for _ in range(REPEATS):
            k = min(k, _seconds(kernel.skinny_linear, x, w))
            t = min(t, _seconds(gemm, x, w))
        if k <= t:
            best = m
    return best


def measure_gemm(onednn: Gemm, mkl: Gemm) -> bool:
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


def _key(dtype: torch.dtype, threads: int, isa: str) -> str:
    # ":gemm2": measured against large_linear (keys without it were against F.linear)
    return f"{str(dtype).removeprefix('torch.')}:{threads}:{isa}:gemm2"


def _gemm_key(threads: int) -> str:
    return f"float32:{threads}:onednn"


def _stored(key: str, measure_now: Callable[[], int]) -> tuple[int, bool]:
    """(the store's value for `key`, False), or (`measure_now()`, True) measured and stored."""
    table = _load()
    if key in table:
        return int(table[key]), False
    value = int(measure_now())
    save(key, value)
    return value, True


def threshold(dtype: torch.dtype, threads: int, isa: str, measure_now: Callable[[], int]) -> int:
    """The stored skinny_linear threshold for (dtype, threads, path), measured by
    `measure_now()` and stored if this machine has none yet."""
    key = _key(dtype, threads, isa)
    rows, measured = _stored(key, measure_now)
    if measured:
        logger.info("skinny_linear threshold %s: %d rows (measured)", key, rows)
    return rows


def _sgemm_key(threads: int, isa: str) -> str:
    return f"float32:{threads}:{isa}:sgemm"


def gemm_choice(threads: int, measure_now: Callable[[], bool]) -> bool:
    """The stored float32 gemm choice (True: oneDNN) at this thread count, measured by
    `measure_now()` and stored if this machine has none yet."""
    wins, measured = _stored(_gemm_key(threads), measure_now)
    if measured:
        logger.info("float32 gemm at %d threads: %s (measured)", threads,
                    "oneDNN" if wins else "F.linear")
    return bool(wins)


def save_threshold(dtype: torch.dtype, threads: int, isa: str, rows: int) -> None:
    save(_key(dtype, threads, isa), rows)


def save_gemm_choice(threads: int, onednn: bool) -> None:
    save(_gemm_key(threads), int(onednn))


def sgemm_choice(threads: int, isa: str, measure_now: Callable[[], bool]) -> bool:
    """The stored choice of the compiled sgemm (True) over the BLAS gemm at this thread count
    and kernel path, measured by `measure_now()` and stored if this machine has none yet."""
    wins, measured = _stored(_sgemm_key(threads, isa), measure_now)
    if measured:
        logger.info("float32 gemm at %d threads, %s path: %s (measured)", threads, isa,
                    "compiled sgemm" if wins else "BLAS")
    return bool(wins)


def save_sgemm_choice(threads: int, isa: str, kernel: bool) -> None:
    save(_sgemm_key(threads, isa), int(kernel))
