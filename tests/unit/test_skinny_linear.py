"""The skinny_linear kernel and the model's `linear` dispatch, against float64 matmuls.

The kernel serves decode steps with few rows; on every instruction-set path this CPU has
(scalar, avx2, avx512, avx512_bf16: the `kernel_isa` fixture forces each) it must equal
x @ w^T to float32 rounding (bf16: to the final bf16 rounding) for every shape (K not a
multiple of the vector step, N not a multiple of 4, M not a multiple of 3), and a row's
result must not depend on how many other rows came with it (a sequence's logits must not
change with its batch).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import calibrate
from engine.kernels import linear as linear_mod

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@DTYPES
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 16, 33])
@pytest.mark.parametrize("n,k", [(1, 8), (3, 13), (4, 64), (9, 100), (1024, 512), (512, 1408)])
def test_kernel_matches_float64_matmul(kernel_isa, dtype, m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    got = kernel_isa.skinny_linear(x, w)
    want = x.double() @ w.double().t()
    assert got.shape == (m, n) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-4 * k ** 0.5)
    else:  # float32 sums, one rounding to bf16 (relative 2^-9) at the end
        torch.testing.assert_close(got.double(), want, rtol=2 ** -8, atol=1e-4 * k ** 0.5)


@DTYPES
@pytest.mark.parametrize("k", [520, 1408])  # rows of x too long for L1 at 16+ rows: slices
def test_a_row_gives_the_same_bits_whatever_its_batch(kernel_isa, dtype, k):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(40, k, generator=gen).to(dtype)  # 32 rows and more: blocks (or groups) of tiles
    w = torch.randn(301, k, generator=gen).to(dtype)  # and a last tile of one weight row
    batch = kernel_isa.skinny_linear(x, w)
    assert torch.equal(kernel_isa.skinny_linear(x[:20].contiguous(), w), batch[:20])
    for i in (0, 5, 19, 33):
        assert torch.equal(kernel_isa.skinny_linear(x[i:i + 1].contiguous(), w), batch[i:i + 1])
        assert torch.equal(kernel_isa.skinny_linear(x[i:i + 7].contiguous(), w), batch[i:i + 7])


def test_kernel_rejects_what_it_cannot_compute(kernel_isa):
    with pytest.raises(RuntimeError, match="float32 or both bfloat16"):
        kernel_isa.skinny_linear(torch.ones(2, 8, dtype=torch.float64), torch.ones(3, 8))
    with pytest.raises(RuntimeError, match="float32 or both bfloat16"):
        kernel_isa.skinny_linear(torch.ones(2, 8).bfloat16(), torch.ones(3, 8))
    with pytest.raises(RuntimeError, match="shapes"):
        kernel_isa.skinny_linear(torch.ones(2, 8), torch.ones(3, 9))
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel_isa.skinny_linear(torch.ones(8, 2).t(), torch.ones(3, 8))


@DTYPES
def test_linear_uses_the_kernel_up_to_the_threshold_and_f_linear_beyond(kernel_isa, dtype,
                                                                        monkeypatch):
    calls = []
    real = kernel_isa.skinny_linear

    class Spy:
        get_isa = kernel_isa.get_isa

        def skinny_linear(self, x, w):
            calls.append(x.shape[0])
            return real(x, w)

    monkeypatch.setattr(linear_mod, "linear_kernel", lambda: Spy())
    monkeypatch.setattr(linear_mod, "skinny_rows", lambda dt: {dtype: 5}.get(dt, 0))
    monkeypatch.setattr(linear_mod, "_skinny", {})  # linear's cache of the two above
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(40, 24, generator=gen).to(dtype), torch.randn(40, generator=gen).to(dtype)
    for m in (1, 5, 6):
        x = torch.randn(m, 24, generator=gen).to(dtype)
        tol = {} if dtype == torch.float32 else {"rtol": 2 ** -7, "atol": 1e-2}
        torch.testing.assert_close(linear_mod.linear(x, w, b), F.linear(x, w, b), **tol)
    assert calls == [1, 5]
    # Other dtypes and shapes keep F.linear.
    other = torch.float16
    torch.testing.assert_close(linear_mod.linear(x[:2].to(other), w.to(other)),
                               F.linear(x[:2].to(other), w.to(other)))
    x3 = torch.randn(2, 3, 24, generator=gen).to(dtype)
    torch.testing.assert_close(linear_mod.linear(x3, w), F.linear(x3, w))
    assert calls == [1, 5]


class _FakeKernel:
    """Instant up to `fast_rows` rows; beyond, three calls of the gemm it is measured against
    (slower than one)."""

    def __init__(self, fast_rows: int) -> None:
        self.fast_rows = fast_rows

    def skinny_linear(self, x, w):
        if x.shape[0] > self.fast_rows:
            for _ in range(3):
                linear_mod.large_linear(x, w)
        return x


@pytest.mark.parametrize("fast_rows,want", [(0, 0), (8, 8), (1000, calibrate.ROWS[-1])])
def test_threshold_is_the_largest_row_count_where_the_kernel_wins(fast_rows, want, monkeypatch):
    monkeypatch.setattr(calibrate, "CALIBRATION_SHAPE", (256, 128))
    got = calibrate.measure(_FakeKernel(fast_rows), torch.float32, linear_mod.large_linear,
                            stop_on_noise=False)  # the decision, whatever the machine's load
    assert got.value == want


class _NoisyKernel(_FakeKernel):
    """Fast from 2 up to `fast_rows` rows and again at 128 (a close race noise decided); at 1
    row as slow as beyond `fast_rows` where `slow_at_one`."""

    def __init__(self, fast_rows: int, slow_at_one: bool) -> None:
        super().__init__(fast_rows)
        self.slow_at_one = slow_at_one

    def skinny_linear(self, x, w):
        m = x.shape[0]
        if not (m <= self.fast_rows or m == 128) or (m == 1 and self.slow_at_one):
            for _ in range(3):
                linear_mod.large_linear(x, w)
        return x


@pytest.mark.parametrize("slow_at_one", [False, True])
def test_threshold_ends_at_the_first_loss_after_a_win(slow_at_one, monkeypatch):
    # 128's "win" after the loss at 32 does not count; a loss at 1 row (a gemv tie) does not end
    # it before the kernel's first win
    monkeypatch.setattr(calibrate, "CALIBRATION_SHAPE", (256, 128))
    got = calibrate.measure(_NoisyKernel(16, slow_at_one), torch.float32,
                            linear_mod.large_linear, stop_on_noise=False)
    assert got.value == 16


class _TiedKernel:
    """Ties the gemm (`_sleep_gemm`) at 1 and 2 rows (2.5 % slower at 2), twice as fast from 4
    to 32, slower from 64: MKL's gemv and gemm against the kernel on a Xeon whose L3 holds
    the calibration weight."""

    def skinny_linear(self, x, w):
        m = x.shape[0]
        time.sleep(0.0039 if m == 1 else 0.0041 if m == 2 else 0.002 if m <= 32 else 0.008)
        return x


def _sleep_gemm(x, w):
    time.sleep(0.004)


def test_a_tie_within_TIE_neither_counts_nor_ends_the_threshold(monkeypatch):
    monkeypatch.setattr(calibrate, "CALIBRATION_SHAPE", (64, 32))
    got = calibrate.measure(_TiedKernel(), torch.float32, _sleep_gemm, stop_on_noise=False)
    assert got.value == 32


def test_the_float32_gemm_is_the_one_measured_faster(monkeypatch):
    monkeypatch.setattr(calibrate, "CALIBRATION_SHAPE", (256, 128))

    def slow(x, w):
        for _ in range(3):
            F.linear(x, w)

    assert calibrate.measure_gemm(F.linear, slow, stop_on_noise=False).value == 1
    assert calibrate.measure_gemm(slow, F.linear, stop_on_noise=False).value == 0


def test_the_float32_gemm_must_win_at_every_row_count(monkeypatch):
    # A Zen 5 EPYC's compiled sgemm at 2 threads won at 256 rows and lost 1.6-1.9x from 2048:
    # a gemm faster on a short chunk only is not chosen.
    monkeypatch.setattr(calibrate, "CALIBRATION_SHAPE", (256, 128))
    assert calibrate.GEMM_ROWS[0] <= 256 < calibrate.GEMM_ROWS[-1]

    def short_only(x, w):
        for _ in range(1 if x.shape[0] <= 256 else 4):
            F.linear(x, w)

    def twice(x, w):
        for _ in range(2):
            F.linear(x, w)

    assert calibrate.measure_gemm(short_only, twice, stop_on_noise=False).value == 0
    assert calibrate.measure_gemm(F.linear, twice, stop_on_noise=False).value == 1


@pytest.mark.parametrize("onednn_wins", [True, False])
def test_large_linear_follows_the_measured_choice(monkeypatch, onednn_wins):
    calls = []

    def spy(x, w, b=None):
        calls.append(x.shape[0])
        return F.linear(x, w, b)

    monkeypatch.setattr(linear_mod, "onednn_linear", spy)
    monkeypatch.setattr(linear_mod, "onednn_sgemm", lambda rows, threads: onednn_wins)
    monkeypatch.setattr(linear_mod, "kernel_sgemm", lambda threads: False)  # test_sgemm.py's
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(300, 64, generator=gen), torch.randn(32, 64, generator=gen)
    torch.testing.assert_close(linear_mod.large_linear(x, w), F.linear(x, w))
    assert calls == ([300] if onednn_wins and linear_mod.ONEDNN else [])


@pytest.mark.parametrize("mkl_from", [0, 512])
def test_large_linear_takes_mkl_from_the_measured_rows(monkeypatch, mkl_from):
    """oneDNN below the measured row count, F.linear (MKL) from it; 0: oneDNN at every count."""
    calls = []

    def spy(x, w, b=None):
        calls.append(x.shape[0])
        return F.linear(x, w, b)

    if not linear_mod.ONEDNN:
        pytest.skip("this torch build has no oneDNN (mkldnn)")
    monkeypatch.setattr(linear_mod, "onednn_linear", spy)
    monkeypatch.setattr(linear_mod, "_mkl_from", lambda threads, isa, shapes: mkl_from)
    monkeypatch.setattr(linear_mod, "kernel_sgemm", lambda threads: False)
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(32, 64, generator=gen)
    for rows in (300, 600):
        x = torch.randn(rows, 64, generator=gen)
        torch.testing.assert_close(linear_mod.large_linear(x, w), F.linear(x, w))
    assert calls == ([300, 600] if mkl_from == 0 else [300])


def test_onednn_linear_is_float32_linear():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(200, 2 * 96, generator=gen)[:, :96]  # rows of any stride
    w, b = torch.randn(48, 96, generator=gen), torch.randn(48, generator=gen)
    if not linear_mod.ONEDNN:
        pytest.skip("this torch build has no oneDNN (mkldnn)")
    torch.testing.assert_close(linear_mod.onednn_linear(x, w, b), F.linear(x, w, b),
                               rtol=1e-5, atol=1e-5)


def _in_subprocess(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


def test_pdserve_linear_torch_turns_the_kernel_off():
    out = _in_subprocess("from engine import kernels; print(kernels.linear_kernel())",
                         PDSERVE_LINEAR="torch")
    assert out.stdout.strip() == "None", out.stderr


def test_pdserve_isa_forces_a_path_and_names_the_paths_on_a_bad_one():
    code = "from engine import kernels; print(kernels.compiled().get_isa())"
    out = _in_subprocess(code, PDSERVE_ISA="scalar")
    assert out.stdout.strip() == "scalar", out.stderr
    out = _in_subprocess(code, PDSERVE_ISA="sse9")
    assert out.returncode != 0
    assert "PDSERVE_ISA=sse9" in out.stderr and "scalar" in out.stderr
