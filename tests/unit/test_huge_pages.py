"""engine/runner/huge_pages.py: the weights move onto one 2 MiB-aligned huge-page region with
their values, a tied parameter once, small ones left where they are."""

from __future__ import annotations

import torch
from torch import nn

from engine.runner.huge_pages import HUGE_PAGE, weights_on_huge_pages


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.embed = nn.Parameter(torch.randn(1000, 700, generator=gen), requires_grad=False)
        self.head = self.embed  # tied, as tie_word_embeddings does
        self.big = nn.Parameter(torch.randn(3, 1 << 19, generator=gen).bfloat16(),
                                requires_grad=False)  # 3 MiB
        self.small = nn.Parameter(torch.randn(64, generator=gen), requires_grad=False)


def test_large_weights_move_onto_one_aligned_region_with_their_values():
    model = _Model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    small_ptr = model.small.data_ptr()
    moved = weights_on_huge_pages(model)
    embed_bytes, big_bytes = 1000 * 700 * 4, 3 * (1 << 19) * 2
    assert moved == embed_bytes + big_bytes  # the tied embedding once; both multiples of 64
    assert model.embed.data_ptr() % HUGE_PAGE == 0  # the region's start
    assert model.big.data_ptr() == model.embed.data_ptr() + embed_bytes
    assert model.head is model.embed and model.small.data_ptr() == small_ptr
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) and p.is_contiguous(), n
    assert model.big.dtype == torch.bfloat16


def test_a_model_without_large_weights_is_left_alone():
    model = nn.Linear(8, 8)
    ptr = model.weight.data_ptr()
    assert weights_on_huge_pages(model) == 0
    assert model.weight.data_ptr() == ptr
