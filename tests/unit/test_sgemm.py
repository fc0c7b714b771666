"""The compiled float32 `sgemm` (engine/kernels/sgemm.cpp) and large_linear's choice of it.

On every path with AVX2+FMA (avx2, avx512, avx512_bf16: the `kernel_isa` fixture forces each)
it must equal x @ w^T to float32 rounding on shapes with every kind of tail (M not a multiple
of the 6-row tile, N not a multiple of the 16-output panel, K past one packed k block and not
a multiple of it, rows of x with a stride), a row's result must not depend on its batch or on
the thread count (bit for bit), and the scalar path must refuse it with a clear error.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import calibrate
from engine.kernels import linear as linear_mod

SHAPES = [(1, 1, 1), (5, 7, 3), (7, 19, 33), (13, 33, 257), (97, 50, 1000), (6, 16, 512),
          (200, 1024, 512), (101, 512, 1408)]


def _avx2(mod) -> None:
    if mod.get_isa() == "scalar":
        pytest.skip("the scalar path has no sgemm")


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_sgemm_matches_float64_matmul(kernel_isa, m, n, k):
    _avx2(kernel_isa)
    gen = torch.Generator().manual_seed(m * 7 + n * 3 + k)
    x = torch.randn(m, 2 * k, generator=gen)[:, :k]  # rows with a stride
    w = torch.randn(n, k, generator=gen)
    got = kernel_isa.sgemm(x, w)
    want = x.double() @ w.double().t()
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-4 * k ** 0.5)


def test_a_rows_result_does_not_depend_on_its_batch_or_threads(kernel_isa):
    _avx2(kernel_isa)
    gen = torch.Generator().manual_seed(11)
    x, w = torch.randn(301, 1408, generator=gen), torch.randn(200, 1408, generator=gen)
    full = kernel_isa.sgemm(x, w)
    for lo, hi in ((0, 1), (5, 12), (100, 301), (295, 301)):
        assert torch.equal(kernel_isa.sgemm(x[lo:hi], w), full[lo:hi])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert torch.equal(kernel_isa.sgemm(x, w), full)
    finally:
        torch.set_num_threads(threads)


def test_scalar_path_refuses_sgemm(kernel_isa):
    if kernel_isa.get_isa() != "scalar":
        pytest.skip("only the scalar path refuses")
    with pytest.raises(RuntimeError, match="sgemm: needs the avx2 path"):
        kernel_isa.sgemm(torch.ones(8, 4), torch.ones(4, 4))


@pytest.mark.parametrize("kernel_wins", [True, False])
def test_large_linear_follows_the_measured_sgemm_choice(monkeypatch, kernel_wins):
    mod = linear_mod.linear_kernel()
    assert mod is not None
    _avx2(mod)
    monkeypatch.setattr(linear_mod, "kernel_sgemm", lambda threads: kernel_wins)
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(300, 64, generator=gen), torch.randn(40, 64, generator=gen)
    b = torch.randn(40, generator=gen)
    got = linear_mod.large_linear(x, w, b)
    torch.testing.assert_close(got, F.linear(x, w, b))
    # The kernel's own rounding where chosen (bias added after), the BLAS gemm's elsewhere.
    want = mod.sgemm(x, w).add_(b) if kernel_wins else linear_mod.blas_linear(x, w, b)
    assert torch.equal(got, want)


@pytest.mark.parametrize("stored", [0, 1])
def test_sgemm_choice_is_read_from_the_store(tmp_path, monkeypatch, stored):
    """Measured once per machine (tests/unit/test_calibration.py), then read: no measuring."""
    mod = linear_mod.linear_kernel()
    _avx2(mod)
    import json
    import time

    path = tmp_path / "k.thresholds.json"
    monkeypatch.setattr(calibrate, "_store", lambda: path)
    threads = torch.get_num_threads()
    key = calibrate.sgemm_key(threads, mod.get_isa(), linear_mod._gemm_shapes)
    path.write_text(json.dumps({key: {"v": stored, "at": time.time()}}))
    linear_mod._sgemm.cache_clear()
    try:
        assert linear_mod.kernel_sgemm(threads) is bool(stored)
    finally:
        linear_mod._sgemm.cache_clear()
