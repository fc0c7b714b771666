"""The compiled rope_ (rope.cpp) against engine/models/rope.py's apply_rotary, on every
instruction-set path (the `kernel_isa` fixture forces each): q and k heads of a fused q|k|v
row rotated in place, the v columns left alone."""

from __future__ import annotations

import pytest
import torch

from engine.models.rope import apply_rotary


@pytest.mark.parametrize("dim", [64, 20])  # 20: a half (10) that no vector width divides
def test_rope_matches_apply_rotary_in_place(kernel_isa, dim):
    gen = torch.Generator().manual_seed(dim)
    t, heads, kv_heads = 37, 6, 2
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=gen)
    cos_sin = torch.randn(t, dim, generator=gen)
    cos, sin = cos_sin[:, None, :dim // 2], cos_sin[:, None, dim // 2:]
    q = qkv[:, :heads * dim].reshape(t, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].reshape(t, kv_heads, dim)
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    v = qkv[:, (heads + kv_heads) * dim:].clone()
    kernel_isa.rope_(qkv, cos, sin, heads + kv_heads)
    torch.testing.assert_close(qkv[:, :heads * dim].reshape(t, heads, dim), want_q,
                               rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(qkv[:, heads * dim:(heads + kv_heads) * dim].reshape(
        t, kv_heads, dim), want_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], v)


def test_rope_rejects_what_it_cannot_rotate(kernel_isa):
    cos = torch.ones(4, 1, 8)
    with pytest.raises(RuntimeError, match="float32"):
        kernel_isa.rope_(torch.ones(4, 32, dtype=torch.bfloat16), cos, cos, 2)
    with pytest.raises(RuntimeError, match="shapes"):
        kernel_isa.rope_(torch.ones(4, 24), cos, cos, 2)
