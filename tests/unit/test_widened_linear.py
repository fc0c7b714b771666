"""bf16 gemms by the float32 gemm on widened operands (engine/kernels/linear.py
`widened_linear`) and large_linear's measured choice of it (`widen_rows`).

The widened gemm must equal x @ w^T + b in float64 to bf16 rounding, in one panel of weight
rows and in many (a large model's matrix is widened a panel at a time); large_linear must
take it from the measured row count on and F.linear below it or where it never pays; the
choice is read from the store; and the measurement returns the smallest row count from which
the widened gemm wins at every larger one.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import calibrate
from engine.kernels import linear as linear_mod


def _operands(m: int, n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    return x, w, b


@pytest.mark.parametrize("panel", [None, 512 * 7, 512])  # one panel; 7 rows; 1 row a panel
@pytest.mark.parametrize("bias", [False, True])
def test_widened_linear_is_the_exact_gemm_rounded_to_bf16(monkeypatch, panel, bias):
    if panel is not None:
        monkeypatch.setattr(linear_mod, "WIDEN_PANEL", panel)
    x, w, b = _operands(70, 45, 512, seed=3)
    got = linear_mod.widened_linear(x, w, b if bias else None)
    want = x.double() @ w.double().t() + (b.double() if bias else 0)
    assert got.shape == (70, 45) and got.dtype == torch.bfloat16
    # half a bf16 step of rounding (2**-9 relative), plus float32's summation error
    torch.testing.assert_close(got.double(), want, rtol=2 ** -8, atol=1e-3)


@pytest.mark.parametrize("rows,m,widened", [(64, 100, True), (64, 50, False), (0, 300, False)])
def test_large_linear_follows_the_measured_widen_rows(monkeypatch, rows, m, widened):
    monkeypatch.setattr(linear_mod, "widen_rows", lambda threads: rows)
    x, w, b = _operands(m, 40, 96, seed=5)
    got = linear_mod.large_linear(x, w, b)
    want = linear_mod.widened_linear(x, w, b) if widened else F.linear(x, w, b)
    assert torch.equal(got, want)


@pytest.mark.parametrize("stored", [0, 128])
def test_widen_rows_are_read_from_the_store(tmp_path, monkeypatch, stored):
    path = tmp_path / "k.thresholds.json"
    monkeypatch.setattr(calibrate, "_store", lambda: path)
    threads = torch.get_num_threads()
    path.write_text(json.dumps({calibrate.widen_key(threads, linear_mod._isa()):
                                {"v": stored, "at": time.time()}}))
    linear_mod._widen.cache_clear()
    try:
        assert linear_mod.widen_rows(threads) == stored
    finally:
        linear_mod._widen.cache_clear()


@pytest.mark.parametrize("from_rows", [512, 128, 0])
def test_measure_from_finds_the_smallest_winning_rows(monkeypatch, from_rows):
    monkeypatch.setattr(calibrate, "CALIBRATION_SHAPE", (64, 32))

    def first(x, w):  # wins (no wait) from `from_rows` rows on
        time.sleep(0 if from_rows and x.shape[0] >= from_rows else 0.004)

    def second(x, w):
        time.sleep(0.002)

    got = calibrate.measure_from(first, second, torch.bfloat16, stop_on_noise=False)
    assert got.value == from_rows


def test_measure_from_takes_the_rows_it_is_given(monkeypatch):
    """The float32 gemm's switch to MKL is measured on MKL_ROWS, not the widening's rows."""
    monkeypatch.setattr(calibrate, "CALIBRATION_SHAPE", (64, 32))
    seen = []

    def first(x, w):  # wins from 256 rows on
        seen.append(x.shape[0])
        time.sleep(0 if x.shape[0] >= 256 else 0.004)

    def second(x, w):
        time.sleep(0.002)

    got = calibrate.measure_from(first, second, torch.float32, stop_on_noise=False,
                                 rows=calibrate.MKL_ROWS)
    # largest first, up to the first loss (128)
    assert got.value == 256 and set(seen) == {m for m in calibrate.MKL_ROWS if m >= 128}


def test_measure_from_times_every_shape_it_is_given(monkeypatch):
    """On a model's layer shapes each candidate runs all of them (scaled to SHAPES_ELEMENTS
    weights together at most, the inner sizes kept)."""
    monkeypatch.setattr(calibrate, "SHAPES_ELEMENTS", 40960)
    shapes = [(960, 32), (320, 32), (2560, 32), (320, 128)]  # 4x that
    seen = []

    def first(x, w):
        seen.append((x.shape[1], tuple(w.shape)))

    calibrate.measure_from(first, first, torch.float32, stop_on_noise=False, rows=(8,),
                           shapes=shapes)
    scaled = calibrate.scaled_shapes(shapes)
    assert scaled == [(240, 32), (80, 32), (640, 32), (80, 128)]
    assert set(seen) == {(i, (o, i)) for o, i in scaled}
    assert calibrate.scaled_shapes([(64, 8)]) == [(64, 8)]  # small enough: unchanged


@pytest.mark.parametrize("slower, want", [(1.2, 64), (3.0, 0)])
def test_measure_from_counts_a_loss_within_tie_as_a_tie(monkeypatch, slower, want):
    """A loss within `tie` neither ends the count nor stops it; a larger one ends it."""
    monkeypatch.setattr(calibrate, "CALIBRATION_SHAPE", (64, 32))

    def first(x, w):
        time.sleep(0.004 * slower)

    def second(x, w):
        time.sleep(0.004)

    got = calibrate.measure_from(first, second, torch.float32, stop_on_noise=False,
                                 rows=calibrate.MKL_ROWS, tie=0.5)
    assert got.value == want


def test_the_skinny_threshold_is_measured_on_the_shapes_given(monkeypatch):
    """calibrate.measure times the kernel and the gemm on every one of the model's shapes, in
    as many copies (tensors of their own) as `streamed_copies` counts for its layers."""
    monkeypatch.setattr(calibrate, "ROWS", (1, 2))
    shapes = [(96, 32), (32, 32), (256, 32), (32, 128)]
    one = 4 * sum(o * i for o, i in shapes)  # one layer's float32 bytes
    monkeypatch.setattr(calibrate, "last_cache_bytes", lambda: 2 * one)  # 4 layers: twice it
    seen, weights = set(), set()

    class Kernel:
        @staticmethod
        def skinny_linear(x, w):
            seen.add(("kernel", x.shape[1], tuple(w.shape)))
            weights.add(("kernel", w.data_ptr()))

    def gemm(x, w):
        seen.add(("gemm", x.shape[1], tuple(w.shape)))
        weights.add(("gemm", w.data_ptr()))

    calibrate.measure(Kernel(), torch.float32, gemm, stop_on_noise=False, shapes=shapes,
                      layers=6)
    assert seen == {(who, i, (o, i)) for who in ("kernel", "gemm") for o, i in shapes}
    assert len(weights) == 2 * 4 * len(shapes)  # 4 copies (of 6 layers) each
    for cap in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        monkeypatch.delenv(cap, raising=False)
    assert calibrate.threshold_key(torch.float32, 2, "avx2", shapes) == \
        "float32:2:avx2:gemm3:96x32,32x32,256x32,32x128"
    assert calibrate.threshold_key(torch.float32, 2, "avx2", shapes, 6) == \
        "float32:2:avx2:gemm3:96x32,32x32,256x32,32x128*6"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # the capped library's choices apart
    assert calibrate.threshold_key(torch.float32, 2, "avx2", shapes) == \
        "float32:2:avx2+ONEDNN_MAX_CPU_ISA=AVX2:gemm3:96x32,32x32,256x32,32x128"
    assert calibrate.widen_key(1, "avx2") == "bfloat16:1:avx2+ONEDNN_MAX_CPU_ISA=AVX2:widen"


def test_the_skinny_threshold_streams_as_many_layers_as_outgrow_the_cache(monkeypatch):
    """A decode step reads every layer's weights once: the threshold's measurement cycles
    through the model's layers up to twice the last cache (then they come from memory as the
    step's do), at most STREAMED_BYTES_MAX, one copy at least."""
    assert calibrate.last_cache_bytes() >= 1 << 20  # this machine's, read from sysfs
    shapes = [(1024, 512), (512, 512), (2816, 512), (512, 1408)]  # bench-llama's
    one = sum(o * i for o, i in shapes)  # elements of one layer (under SHAPES_ELEMENTS)
    monkeypatch.setattr(calibrate, "last_cache_bytes", lambda: 32 << 20)
    assert calibrate.streamed_copies(torch.bfloat16, shapes, 8) == 8  # 47 MB: all
    assert calibrate.streamed_copies(torch.float32, shapes, 8) == -(-(64 << 20) // (4 * one))
    assert calibrate.streamed_copies(torch.float32, shapes, 2) == 2  # a small model: in cache
    assert calibrate.streamed_copies(torch.float32, shapes, 1) == 1
    assert calibrate.streamed_copies(torch.float32, (), 1) == 1  # no model: one weight
    monkeypatch.setattr(calibrate, "last_cache_bytes", lambda: 1 << 30)  # a huge L3: capped
    assert calibrate.streamed_copies(torch.float32, shapes, 1000) == \
        -(-calibrate.STREAMED_BYTES_MAX // (4 * one))
