"""The skinny_linear kernel and the model's `linear` dispatch, against float64 matmuls.

The kernel serves decode steps with few rows; it must equal x @ w^T to float32 rounding for
every shape (K not a multiple of 8, N not a multiple of 4, M not a multiple of 3), and a row's
result must not depend on how many other rows came with it (a sequence's logits must not
change with its batch).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from engine.models import linear as linear_mod
from engine.worker import kernels


def _has_avx2_fma() -> bool:
    with open("/proc/cpuinfo") as f:
        flags = next((ln for ln in f if ln.startswith("flags")), "").split()
    return "avx2" in flags and "fma" in flags


@pytest.fixture(scope="module")
def kernel():
    if not _has_avx2_fma():
        pytest.skip("this CPU has no AVX2/FMA: the kernel is compiled out and F.linear serves")
    mod = kernels.linear_kernel()
    # gcc and ninja are installed by `make install`: a missing kernel is a failure here.
    assert mod is not None, "the skinny_linear kernel did not build"
    return mod


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 16, 33])
@pytest.mark.parametrize("n,k", [(1, 8), (3, 13), (4, 64), (9, 100), (1024, 512), (512, 1408)])
def test_kernel_matches_float64_matmul(kernel, m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    got = kernel.skinny_linear(x, w)
    want = (x.double() @ w.double().t()).float()
    assert got.shape == (m, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * k ** 0.5)


def test_a_row_gives_the_same_bits_whatever_its_batch(kernel):
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(20, 512, generator=gen), torch.randn(300, 512, generator=gen)
    batch = kernel.skinny_linear(x, w)
    for i in (0, 5, 19):
        assert torch.equal(kernel.skinny_linear(x[i:i + 1].contiguous(), w), batch[i:i + 1])
        assert torch.equal(kernel.skinny_linear(x[i:i + 7].contiguous(), w), batch[i:i + 7])


def test_kernel_rejects_what_it_cannot_compute(kernel):
    with pytest.raises(RuntimeError, match="float32"):
        kernel.skinny_linear(torch.ones(2, 8, dtype=torch.float64), torch.ones(3, 8))
    with pytest.raises(RuntimeError, match="shapes"):
        kernel.skinny_linear(torch.ones(2, 8), torch.ones(3, 9))
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel.skinny_linear(torch.ones(8, 2).t(), torch.ones(3, 8))


def test_linear_uses_the_kernel_for_few_rows_and_f_linear_beyond(kernel, monkeypatch):
    calls = []
    real = kernel.skinny_linear

    class Spy:
        def skinny_linear(self, x, w):
            calls.append(x.shape[0])
            return real(x, w)

    monkeypatch.setattr(linear_mod, "linear_kernel", lambda: Spy())
    limit = linear_mod.SKINNY_ROWS_PER_THREAD * torch.get_num_threads()
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    for m in (1, limit, limit + 1):
        x = torch.randn(m, 24, generator=gen)
        torch.testing.assert_close(linear_mod.linear(x, w, b), F.linear(x, w, b))
    assert calls == [1, limit]
    # Other dtypes and shapes keep F.linear.
    xb, wb = torch.randn(2, 24).bfloat16(), torch.randn(40, 24).bfloat16()
    torch.testing.assert_close(linear_mod.linear(xb, wb), F.linear(xb, wb))
    x3 = torch.randn(2, 3, 24, generator=gen)
    torch.testing.assert_close(linear_mod.linear(x3, w), F.linear(x3, w))
    assert calls == [1, limit]


def test_pdserve_linear_torch_turns_the_kernel_off():
    code = "from engine.worker import kernels; print(kernels.linear_kernel() is None)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PDSERVE_LINEAR": "torch"})
    assert out.stdout.strip() == "True"
