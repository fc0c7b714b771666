"""The decoder layers' compiled helpers against the torch code they replace, on every
instruction-set path (the `kernel_isa` fixture forces each): rope_ (rope.cpp) against
engine/models/rope.py's apply_rotary, q and k heads of a fused q|k|v row rotated in place and
the v columns left alone; add_rms_norm (rms_norm.cpp) against an add and F.rms_norm;
silu_mul (silu_mul.cpp) against F.silu(gate) * up. In bf16 each against the torch code the
layers run without it (engine/models/layers.py, rope.py: transformers' roundings)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.layers import rms_norm
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


@pytest.mark.parametrize("dim", [64, 20])
def test_rope_on_bf16_rounds_as_apply_rotary_does(kernel_isa, dim):
    gen = torch.Generator().manual_seed(dim + 1)
    t, heads, kv_heads = 23, 4, 2
    qkv = (torch.randn(t, (heads + 2 * kv_heads) * dim, generator=gen) * 3).bfloat16()
    cos_sin = torch.randn(t, dim, generator=gen).bfloat16()  # the model's cache is bf16
    cos, sin = cos_sin[:, None, :dim // 2], cos_sin[:, None, dim // 2:]
    qk = qkv[:, :(heads + kv_heads) * dim].reshape(t, heads + kv_heads, dim)
    want = apply_rotary(qk, cos, sin)  # every product and sum rounded to bf16
    v = qkv[:, (heads + kv_heads) * dim:].clone()
    kernel_isa.rope_(qkv, cos, sin, heads + kv_heads)
    got = qkv[:, :(heads + kv_heads) * dim].reshape(t, heads + kv_heads, dim)
    assert torch.equal(got, want)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], v)


def test_rope_rejects_what_it_cannot_rotate(kernel_isa):
    cos = torch.ones(4, 1, 8)
    with pytest.raises(RuntimeError, match="float32"):
        kernel_isa.rope_(torch.ones(4, 32, dtype=torch.bfloat16), cos, cos, 2)  # mixed dtypes
    with pytest.raises(RuntimeError, match="float32"):
        kernel_isa.rope_(torch.ones(4, 32, dtype=torch.float64), cos.double(), cos.double(), 2)
    with pytest.raises(RuntimeError, match="shapes"):
        kernel_isa.rope_(torch.ones(4, 24), cos, cos, 2)


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("n", [512, 40])  # 40: a row no vector width divides
def test_add_rms_norm_matches_torch(kernel_isa, with_residual, n):
    gen = torch.Generator().manual_seed(n)
    x, res = torch.randn(9, n, generator=gen), torch.randn(9, n, generator=gen)
    w = torch.randn(n, generator=gen)
    want_r = x + res if with_residual else x
    want_h = F.rms_norm(want_r, (n,), w, 1e-6)
    h, r = kernel_isa.add_rms_norm(x, res if with_residual else None, w, 1e-6)
    torch.testing.assert_close(r, want_r, rtol=0, atol=0)
    torch.testing.assert_close(h, want_h, rtol=1e-5, atol=1e-5)
    assert r.data_ptr() != x.data_ptr()  # a new tensor, never x itself


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("n", [512, 40])
def test_add_rms_norm_on_bf16_rounds_as_the_torch_layers_do(kernel_isa, with_residual, n):
    gen = torch.Generator().manual_seed(n + 1)
    x = (torch.randn(9, n, generator=gen) * 4).bfloat16()
    res = (torch.randn(9, n, generator=gen) * 4).bfloat16()
    w = (torch.rand(n, generator=gen) + 0.5).bfloat16()
    want_r = x + res if with_residual else x  # torch's bf16 add: one rounding
    want_h = rms_norm(want_r, w, 1e-6)  # float32 norm, to bf16, times w in bf16
    h, r = kernel_isa.add_rms_norm(x, res if with_residual else None, w, 1e-6)
    assert h.dtype == r.dtype == torch.bfloat16
    assert torch.equal(r, want_r) and r.data_ptr() != x.data_ptr()
    # The sum of squares runs in another order than torch's: a value on a bf16 rounding
    # boundary may round the other way (one bf16 step), nothing more.
    differ = (h != want_h).float().mean().item()
    assert differ < 0.01, f"{differ:.2%} of the values differ from torch's"
    torch.testing.assert_close(h.float(), want_h.float(), rtol=2 ** -7, atol=0)
    with pytest.raises(RuntimeError, match="one dtype"):
        kernel_isa.add_rms_norm(x, None, w.float(), 1e-6)


@pytest.mark.parametrize("inter", [1408, 37])  # 37: a row no vector width divides
def test_silu_mul_on_bf16_rounds_as_torch_does(kernel_isa, inter):
    gen = torch.Generator().manual_seed(inter + 1)
    gate_up = (torch.randn(7, 2 * inter, generator=gen) * 4).bfloat16()
    gate, up = gate_up.split((inter, inter), dim=-1)
    want = F.silu(gate) * up  # what transformers computes: two bf16 roundings
    got = kernel_isa.silu_mul(gate_up, inter)
    assert got.dtype == torch.bfloat16 and got.shape == (7, inter) and got.is_contiguous()
    differ = (got != want).float().mean().item()
    assert differ < 1e-3, f"{differ:.2%} of the values differ from torch's"  # ulp-boundary ties
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("inter", [1408, 37])  # 37: a row no vector width divides
def test_silu_mul_matches_torch(kernel_isa, inter):
    gen = torch.Generator().manual_seed(inter)
    gate_up = torch.randn(5, 2 * inter, generator=gen) * 8  # well into both tails
    gate_up[0, :4] = torch.tensor([0.0, -0.0, 90.0, -90.0])  # sign edges, exp's clamp
    gate, up = gate_up.split((inter, inter), dim=-1)
    want = F.silu(gate) * up
    before = gate_up.clone()
    got = kernel_isa.silu_mul(gate_up, inter)
    assert got.shape == (5, inter) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(gate_up, before)  # the input is left as it was
