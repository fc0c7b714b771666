"""The head-range descriptor arithmetic (kvconnector/tp_layout.py) against torch slicing of
real caches ``[blocks, layers, 2, block_size, heads, head_dim]``: applying the descriptors as
byte copies must move exactly the heads both ranks hold, into the right blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvconnector.tp_layout import HeadLayout, peer_ranks, transfer_descs

L, BS, H, HD, BLOCKS = 3, 4, 4, 5, 8


def _rank(rank: int, size: int, dtype: torch.dtype) -> tuple[HeadLayout, torch.Tensor]:
    n = H // size
    layout = HeadLayout(L, BS, n, rank * n, H, HD, torch.empty((), dtype=dtype).element_size())
    return layout, torch.zeros(BLOCKS, L, 2, BS, n, HD, dtype=dtype)


def _apply(local: np.ndarray, src: torch.Tensor, remote: np.ndarray, dst: torch.Tensor) -> None:
    """Run the descriptor pairs as byte copies (addresses relative to each cache's start)."""
    s, d = src.view(torch.uint8).reshape(-1), dst.view(torch.uint8).reshape(-1)
    assert len(local) == len(remote)
    for (la, ln, _), (ra, rn, _) in zip(local.tolist(), remote.tolist(), strict=True):
        assert ln == rn
        d[ra:ra + rn] = s[la:la + ln]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("p_size", "d_size"), [(2, 1), (1, 2), (4, 2), (2, 4), (2, 2), (1, 1)])
def test_descriptors_move_exactly_the_shared_heads_into_the_right_blocks(p_size, d_size, dtype):
    p_ids, d_ids = np.array([6, 1, 2]), np.array([0, 5, 3])
    full = torch.randn(BLOCKS, L, 2, BS, H, HD).to(dtype)
    for p in range(p_size):
        p_layout, p_cache = _rank(p, p_size, dtype)
        p_cache.copy_(full[..., p_layout.first_head:p_layout.first_head + p_layout.heads, :])
        for d in peer_ranks(p, p_size, d_size):
            d_layout, d_cache = _rank(d, d_size, dtype)
            loc, rem = transfer_descs(p_layout, 0, p_ids, 0, d_layout, 0, d_ids, 0)
            _apply(loc, p_cache, rem, d_cache)
            lo = max(p_layout.first_head, d_layout.first_head)
            hi = min(p_layout.first_head + p_layout.heads, d_layout.first_head + d_layout.heads)
            expect = torch.zeros_like(d_cache)
            expect[d_ids, ..., lo - d_layout.first_head:hi - d_layout.first_head, :] = (
                full[p_ids][..., lo:hi, :])
            assert torch.equal(d_cache, expect)
            # whole blocks on both sides are one descriptor per block, else one per run
            per_block = 1 if p_size == d_size else L * 2 * BS
            assert len(loc) == len(p_ids) * per_block


def test_every_head_is_written_once_from_the_ranks_that_hold_it():
    for p_size, d_size in [(2, 1), (1, 2), (4, 1), (1, 4), (2, 2), (4, 2)]:
        for d in range(d_size):
            ranks = peer_ranks(d, d_size, p_size)
            assert ranks == [p for p in range(p_size) if d in peer_ranks(p, p_size, d_size)]
            assert len(ranks) == max(1, p_size // d_size)


def test_a_head_range_outside_the_rank_is_refused():
    layout, _ = _rank(1, 2, torch.float32)
    with pytest.raises(ValueError, match="not all in this rank's"):
        layout.run_offsets(0, 2)
