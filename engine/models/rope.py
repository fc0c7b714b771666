"""Rotary position embedding: inverse frequencies per scaling type and a precomputed cache.

The cache holds cos and sin for every position below max_position_embeddings, computed in
float32 exactly as Hugging Face does (position * inv_freq, then cos/sin) and cast once to the
model dtype, so a lookup is one index_select and the rotation is a few elementwise ops.
"""

from __future__ import annotations

import math

import torch

from engine.models.arch import RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Float32 [head_dim // 2] inverse frequencies for `rope`'s scaling type."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta ** exponent)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def build_cos_sin_cache(rope: RopeConfig, head_dim: int, max_positions: int,
                        dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """[max_positions, head_dim] tensor: cos in the first half of the last dim, sin in the second.

    Only head_dim // 2 distinct frequencies exist (HF duplicates them), so half of each is kept.
    """
    inv_freq = inv_frequencies(rope, head_dim)
    pos = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype=dtype, device=device)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by per-token cos/sin [T, 1, head_dim // 2] (NeoX layout).

    Returns a new contiguous tensor; equals HF's `x * cos + rotate_half(x) * sin`.
    """
    half = x.shape[-1] // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
