"""The model's matmuls: `linear(x, w, b)` is F.linear, except for a few rows on the CPU.

A decode step with a small batch multiplies a few rows by every weight matrix; the time is
the weight's trip from memory, and the BLAS gemm behind F.linear spends up to twice that. For
float32 or bfloat16 CPU inputs of at most `skinny_rows(dtype)` rows the compiled
`skinny_linear` kernel (engine/kernels/skinny_linear.cpp) streams the weight once
instead (bf16 with vdpbf16ps where the CPU has AVX512-BF16). The row threshold is measured
on this machine for its dtype, thread count and kernel path (engine/kernels/
calibrate.py); beyond it the blocked gemm wins. For float32 that gemm (`large_linear`) is
the compiled AVX2+FMA `sgemm` (engine/kernels/sgemm.cpp: 6x16 register tile, packed weight
panels; a row's result independent of its batch) where this machine measured it faster than
the BLAS choice below (per thread count and kernel path), else oneDNN's matmul (torch's own
mkldnn build, on the plain weight: no packed copy, full float32) or the MKL sgemm behind
F.linear by the row count: MKL from the rows where this machine measured it not slower at
every larger count on the loaded model's layer shapes (`mkl_from_rows`, per thread count and
kernel path, like the thresholds), oneDNN below.
On an AVX-512 AMD EPYC oneDNN is 1.3x MKL on the model's prefill shapes; on an Intel Xeon
(Emerald Rapids) oneDNN wins at 256 rows and MKL at 1024 (docs/performance.md).
bf16 F.linear goes to oneDNN, except from `widen_rows` rows on
where this machine measured the float32 gemm on widened operands faster (`widened_linear`:
a core whose vdpbf16ps runs at half its float32 FMAs' rate, as an Intel Golden Cove Xeon
without AMX does). PDSERVE_LINEAR=torch keeps F.linear everywhere. The same measured store
holds one attention choice: `bf16_attention_pairs()`, whether bf16 prefill attention runs
on vdpbf16ps pairs or on float32 FMA tiles on such a core.
`row_kernels(x)` hands the layers the compiled row kernels for float32 and bf16: `rope_`
(rope.cpp: q and k rotated in place in a q|k|v matmul output, one pass), `add_rms_norm`
(rms_norm.cpp) and the SwiGLU activation `silu_mul` (silu_mul.cpp).
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

import torch
import torch.nn.functional as F

from engine import kernels
from engine.kernels import calibrate, compiled, linear_kernel

logger = logging.getLogger(__name__)

ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] @ weight[out, in]^T + bias, as F.linear."""
    if x.dim() == 2 and x.dtype == weight.dtype and x.is_cpu:
        kernel = skinny_kernel(x.dtype, x.shape[0])
        if kernel is not None:
            y = kernel.skinny_linear(x.contiguous(), weight.contiguous())
            return y if bias is None else y.add_(bias)
        return large_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def skinny_kernel(dtype: torch.dtype, rows: int) -> ModuleType | None:
    """The kernels' module where `linear` runs a CPU x of `rows` rows and this dtype on
    `skinny_linear` (the rows are within the measured threshold), else None."""
    limit, kernel = _skinny.get((dtype, torch.get_num_threads())) or _skinny_now(dtype)
    return kernel if rows <= limit else None


# (dtype, threads) -> (skinny rows, kernel) once the threshold is final: a decode step calls
# `linear` ~4 times a layer, and looking both up each time (the environment, the store's
# choice) cost ~6 us a call, ~0.2 ms of a bf16 batch-1 step (issue 33)
_skinny: dict[tuple[torch.dtype, int], tuple[int, ModuleType | None]] = {}


def _skinny_now(dtype: torch.dtype) -> tuple[int, ModuleType | None]:
    kernel, threads = linear_kernel(), torch.get_num_threads()
    rows = skinny_rows(dtype)
    if (kernel is None or dtype not in (torch.float32, torch.bfloat16)
            or (dtype, threads, kernel.get_isa(), _gemm_shapes, _gemm_layers)
            in _thresholds.final):
        _skinny[(dtype, threads)] = (rows, kernel)  # final: it no longer changes
    return rows, kernel


def large_linear(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """The gemm for a CPU x [M, in] of more rows than the skinny kernel takes: for float32
    the compiled AVX2 `sgemm` (sgemm.cpp) where this machine measured it faster than the BLAS
    choice, else oneDNN's matmul (x of any row stride) where measured faster than MKL, else
    (and with PDSERVE_LINEAR=torch) F.linear."""
    if x.dtype == torch.float32 and os.environ.get("PDSERVE_LINEAR") != "torch":
        threads = torch.get_num_threads()
        kernel = sgemm_kernel()
        if kernel is not None and kernel_sgemm(threads):
            y = kernel.sgemm(x, weight)
            return y if bias is None else y.add_(bias)
        if ONEDNN and weight.is_contiguous() and onednn_sgemm(x.shape[0], threads):
            return onednn_linear(x, weight, bias)
    elif x.dtype == torch.bfloat16 and os.environ.get("PDSERVE_LINEAR") != "torch":
        rows = widen_rows(torch.get_num_threads())
        if rows and x.shape[0] >= rows:
            return widened_linear(x, weight, bias)
    return F.linear(x, weight, bias)


# At most this many weight elements widened at once (16 MiB of float32): a large model's
# matrix never has a whole float32 copy.
WIDEN_PANEL = 1 << 22


def widened_linear(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 F.linear by the float32 gemm (`large_linear`): x and the weight widened to float32,
    the weight a panel of at most WIDEN_PANEL elements at a time, each output rounded to bf16
    once. The products are exact (a bf16 widens exactly, and two bf16 significands' product
    fits a float32's) and summed in float32, as oneDNN's bf16 gemm does, in another order.
    On a core whose vdpbf16ps runs at half its FMAs' rate (86 vs 176 GFLOP/s a thread on an
    Intel Xeon with AVX512-BF16 and no AMX) 1.1x F.linear at 64 rows, 1.6-1.8x at 1024."""
    x32 = x.to(torch.float32, memory_format=torch.contiguous_format)
    b32 = None if bias is None else bias.float()
    n, k = weight.shape
    step = max(1, WIDEN_PANEL // max(1, k))
    if step >= n:
        return large_linear(x32, weight.float(), b32).to(torch.bfloat16)
    y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    for n0 in range(0, n, step):
        n1 = min(n, n0 + step)
        y[:, n0:n1] = large_linear(x32, weight[n0:n1].float(),
                                   None if b32 is None else b32[n0:n1])
    return y


def _isa() -> str:
    kernel = linear_kernel()
    return kernel.get_isa() if kernel is not None else "torch"


_widen = calibrate.Choices(
    "bf16 gemm widened to float32 from rows (0: never)", calibrate.widen_key,
    lambda threads, isa: calibrate.measure_from(widened_linear, F.linear, torch.bfloat16),
    lambda threads, isa: 0)


def widen_rows(threads: int) -> int:
    """From how many rows bf16 gemms beyond the skinny rows go to `widened_linear` at this
    thread count and kernel path (0: never): measured once per machine where quiet, then
    read from the store."""
    return _widen(threads, _isa())


_attn_pairs = calibrate.Choices(
    "bf16 prefill attention on vdpbf16ps pairs (1) or float32 tiles (0)",
    calibrate.attention_key, lambda threads, isa: calibrate.measure_attention(compiled()),
    lambda threads, isa: 1)


def bf16_attention_pairs() -> bool:
    """prefill_attention's bf16_pairs for this thread count: measured once per machine where
    the kernels run on avx512_bf16 (the only path with pairs), then read from the store."""
    isa = _isa()
    return isa != "avx512_bf16" or bool(_attn_pairs(torch.get_num_threads(), isa))


def blas_linear(x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 gemm `large_linear` runs without the compiled sgemm (oneDNN or MKL)."""
    if ONEDNN and weight.is_contiguous() and onednn_sgemm(x.shape[0], torch.get_num_threads()):
        return onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear by oneDNN's matmul (float32 CPU tensors, weight contiguous)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [None], "")


_mkl_from = calibrate.Choices(
    "float32 gemm F.linear (MKL) from rows (0: never; oneDNN below)", calibrate.gemm_key,
    lambda threads, isa, shapes: calibrate.measure_from(
        F.linear, onednn_linear, torch.float32, rows=calibrate.MKL_ROWS, shapes=shapes,
        tie=calibrate.TIE),
    lambda threads, isa, shapes: 0)

# The loaded model's layer weight shapes ([out, in]; a TP rank's shard), which the skinny
# threshold and the float32 gemm's choice are measured on; () before a model is loaded: the
# calibration shape. And its layer count: the skinny threshold is measured on as many copies
# (calibrate.streamed_copies), read from memory where they outgrow the cache, as a step's are.
_gemm_shapes: tuple[tuple[int, int], ...] = ()
_gemm_layers = 1


def set_gemm_shapes(shapes: list[tuple[int, int]], layers: int = 1) -> None:
    """The model this process runs: the skinny threshold and the float32 gemm's choice are
    measured on these shapes (its layer weights'), the threshold on `layers` of them."""
    global _gemm_shapes, _gemm_layers
    if (tuple(shapes), layers) != (_gemm_shapes, _gemm_layers):
        _gemm_shapes, _gemm_layers = tuple(shapes), layers
        _skinny.clear()  # linear's cache of the threshold: another model's


def mkl_from_rows(threads: int) -> int:
    """From how many rows float32 gemms beyond the skinny rows go to F.linear (MKL) at this
    thread count and kernel path, oneDNN below (0: never MKL), for the model's layer shapes:
    measured once per machine where quiet, then read from the store; oneDNN meanwhile (MKL
    takes its AVX2 code on an AMD CPU: 0.45 of oneDNN's rate on a Zen 5 EPYC, 16-2048 rows
    of the bench model's layers; on an Intel Xeon the two were within 4-15 %)."""
    return _mkl_from(threads, _isa(), _gemm_shapes)


def onednn_sgemm(rows: int, threads: int) -> bool:
    """Whether a float32 gemm of `rows` rows beyond the skinny rows goes to oneDNN at this
    thread count (else F.linear)."""
    mkl = mkl_from_rows(threads)
    return mkl == 0 or rows < mkl


def sgemm_kernel() -> ModuleType | None:
    """The kernels' module where its path has `sgemm` (AVX2+FMA or wider), else None."""
    kernel = kernels.linear_kernel()
    return kernel if kernel is not None and kernel.get_isa() != "scalar" else None


def _measure_sgemm(threads: int, isa: str, shapes: tuple) -> calibrate.Measured:
    """The compiled sgemm against `blas_linear`, once that one's own choice is measured: timed
    against a default it had stored a wrong answer (on a Zen 5 EPYC at 2 threads the sgemm beat
    the then-default MKL, which runs its AVX2 code there, and loses to oneDNN, the measured
    choice: 2-thread prefills ran at 0.44 of the FMA peak instead of 0.80)."""
    if ONEDNN:
        _mkl_from(threads, isa, shapes)  # the stored value, or measured now
        if (threads, isa, shapes) not in _mkl_from.final:
            return calibrate.Measured(None, "the BLAS choice it races is not measured yet")
    return calibrate.measure_gemm(sgemm_kernel().sgemm, blas_linear, shapes=shapes)


_sgemm = calibrate.Choices(
    "float32 gemm compiled sgemm (1) or BLAS (0)", calibrate.sgemm_key, _measure_sgemm,
    lambda threads, isa, shapes: 0)


def kernel_sgemm(threads: int) -> bool:
    """Whether float32 gemms beyond the skinny rows go to the compiled sgemm at this thread
    count and kernel path (else `blas_linear`), for the model's layer shapes: measured once
    per machine where quiet, then read from the store."""
    return bool(_sgemm(threads, sgemm_kernel().get_isa(), _gemm_shapes))


_thresholds = calibrate.Choices(
    "skinny_linear rows", calibrate.threshold_key,
    lambda dtype, threads, isa, shapes, layers: calibrate.measure(
        linear_kernel(), dtype, large_linear, shapes=shapes, layers=layers),
    lambda dtype, threads, isa, shapes, layers: calibrate.DEFAULT_ROWS)


def skinny_rows(dtype: torch.dtype) -> int:
    """Up to how many rows `linear` should use the kernel for this dtype, thread count and path
    (0: never). Measured once per machine where quiet, then read from the store; a safe
    default meanwhile (engine/kernels/calibrate.py)."""
    kernel = linear_kernel()
    if kernel is None or dtype not in (torch.float32, torch.bfloat16):
        return 0
    return _thresholds(dtype, torch.get_num_threads(), kernel.get_isa(), _gemm_shapes,
                       _gemm_layers)


def recalibrate() -> dict[str, int | None]:
    """Measure every choice again at this process's thread count and path, storing those
    measured quietly (None: noisy, not stored; the store keeps what it held)."""
    kernel = linear_kernel()
    if kernel is None:
        return {}
    for choices in (_mkl_from, _sgemm, _thresholds, _widen, _attn_pairs):
        choices.cache_clear()
    _skinny.clear()
    threads, isa, shapes = torch.get_num_threads(), kernel.get_isa(), _gemm_shapes
    # each choice's own key and measurement, in an order where a gemm is settled before the
    # choices timed against it (the widened gemm is large_linear's)
    runs: dict[str, tuple[calibrate.Choices, tuple]] = {}
    if ONEDNN:
        runs["float32_mkl_from"] = (_mkl_from, (threads, isa, shapes))
    if sgemm_kernel() is not None:
        runs["float32_sgemm"] = (_sgemm, (threads, isa, shapes))
    for dtype in (torch.float32, torch.bfloat16):
        runs[str(dtype).removeprefix("torch.")] = (_thresholds,
                                                   (dtype, threads, isa, shapes, _gemm_layers))
    runs["bfloat16_widen"] = (_widen, (threads, isa))
    if isa == "avx512_bf16":
        runs["bfloat16_attention_pairs"] = (_attn_pairs, (threads, isa))
    out: dict[str, int | None] = {}
    for name, (choices, args) in runs.items():
        key = choices.key_of(*args)
        got = calibrate.measure_and_store(key, lambda c=choices, a=args: c.measure_of(*a))
        out[name] = got.value if got.noise is None else None
        if got.noise is not None:
            logger.warning("%s: %s, not stored", key, got.noise)
    return out


def row_kernels(x: torch.Tensor) -> ModuleType | None:
    """The kernels' module for `rope_`, `add_rms_norm` and `silu_mul` on x, a float32 or bf16
    CPU [T, n] tensor (bf16 with the roundings of the layers' torch code, which transformers'
    bf16 layers share); None where that torch code runs. In bf16 they are most of a decode
    step's fixed cost: rms_norm alone is ~10 torch ops (casts around a float32 norm),
    apply_rotary 7, each a dispatch."""
    if x.dtype not in (torch.float32, torch.bfloat16) or not x.is_cpu or x.dim() != 2:
        return None
    return compiled()
