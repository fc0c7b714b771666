"""Greedy decoding's compiled argmax (engine/kernels/argmax.cpp) against torch.argmax, the
referee greedy decoding has always used: the same index on every row, on every
instruction-set path — ties (the first maximum wins), NaN (the first NaN wins), infinities,
-0.0 beside 0.0, rows of -inf, widths on and off its 256-value blocks, one column. (Its
speed against torch's: scripts/argmax_ab.py.)"""

from __future__ import annotations

import torch

from engine.kernels.argmax import argmax_rows


def _cases():
    gen = torch.Generator().manual_seed(7)
    for width in (1, 2, 15, 16, 255, 256, 257, 1000, 4096, 8192 + 77):
        for rows in (1, 3, 9):
            yield f"randn {rows}x{width}", torch.randn(rows, width, generator=gen)
            ties = torch.randint(-2, 3, (rows, width), generator=gen).float()
            yield f"ties {rows}x{width}", ties
            nan = torch.randn(rows, width, generator=gen)
            nan[torch.rand(rows, width, generator=gen) < 0.01] = float("nan")
            nan[0, -1] = float("nan")  # a NaN after the maximum: still the NaN
            yield f"nan {rows}x{width}", nan
            inf = torch.randn(rows, width, generator=gen)
            inf[torch.rand(rows, width, generator=gen) < 0.5] = float("-inf")  # masked
            inf[-1, width // 2] = float("inf")
            yield f"inf {rows}x{width}", inf
            yield f"all -inf {rows}x{width}", torch.full((rows, width), float("-inf"))
            zeros = torch.zeros(rows, width)
            zeros[torch.rand(rows, width, generator=gen) < 0.5] = -0.0
            yield f"signed zeros {rows}x{width}", zeros
    late = torch.full((2, 5000), -1.0)
    late[0, 4999] = 0.0  # the maximum in the ragged tail after the last whole block
    late[1, 300] = late[1, 4000] = 3.0  # equal maxima in two blocks: the first
    yield "late and repeated maxima", late


def test_argmax_rows_gives_torch_argmax_on_every_path(kernel_isa):
    for name, x in _cases():
        assert torch.equal(kernel_isa.argmax_rows(x), x.argmax(dim=-1)), name


def test_the_wrapper_takes_any_layout_and_falls_back_to_torch_for_other_dtypes():
    x = torch.randn(6, 3000)
    strided = x[:, :2500]  # a TP rank's columns without the padding: not contiguous
    assert torch.equal(argmax_rows(strided), strided.argmax(dim=-1))
    half = x.bfloat16()
    assert torch.equal(argmax_rows(half), half.argmax(dim=-1))
    assert argmax_rows(x).dtype == torch.long

