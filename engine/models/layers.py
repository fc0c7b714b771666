"""One decoder layer of the Llama / Qwen2 / Qwen3 family, on flattened tokens.

Weights are stored fused (q|k|v in one matrix, gate|up in one matrix) so each layer runs four
matmuls. With tensor parallelism a layer holds only its rank's heads and its slice of the MLP;
the row-parallel outputs (o_proj, down_proj) are summed across ranks by `all_reduce`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.linear import linear, row_kernels
from engine.models.arch import ModelArch
from engine.models.parallel import AllReduceFn, TPLayout
from engine.models.rope import apply_rotary

# attn(layer_idx, q [T, H, D], k [T, KV, D], v [T, KV, D]) -> [T, H, D]; q, k and v have
# contiguous heads (unit last stride, head h at h * D) but rows of any stride: with the rope
# kernel they are views of the fused q|k|v matmul output.
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim with HF's rounding: normalise in float32, cast, then scale."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # One fused float32 norm, then HF's cast and scale (3 ops, not 7: a bf16 decode step runs
    # 2 per layer, and each op costs a few microseconds of dispatch).
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x), residual None meaning x alone: one compiled call
    for float32 and bf16 on the CPU (add_rms_norm, rms_norm.cpp), else a torch add and
    rms_norm."""
    kernel = row_kernels(x) if x.is_contiguous() and weight.dtype == x.dtype else None
    if kernel is not None and (residual is None or residual.is_contiguous()):
        return kernel.add_rms_norm(x, residual, weight, eps)
    residual = x if residual is None else residual + x
    return rms_norm(residual, weight, eps), residual


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP block. Weights start uninitialised; the loader fills them."""

    def __init__(self, arch: ModelArch, layer_idx: int, dtype: torch.dtype,
                 device: torch.device | str, layout: TPLayout | None = None) -> None:
        super().__init__()
        layout = layout or TPLayout.of(arch, 0, 1)
        self.layer_idx = layer_idx
        self.eps = arch.rms_norm_eps
        self.num_heads = layout.num_heads
        self.num_kv_heads = layout.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.inter_size = layout.intermediate_size
        hidden = arch.hidden_size
        kw = {"dtype": dtype, "device": device}

        self.input_norm = empty_param(hidden, **kw)
        self.post_attn_norm = empty_param(hidden, **kw)
        self.qkv_weight = empty_param(self.q_size + 2 * self.kv_size, hidden, **kw)
        self.qkv_bias = empty_param(self.q_size + 2 * self.kv_size, **kw) if arch.qkv_bias else None
        self.o_weight = empty_param(hidden, self.q_size, **kw)
        self.o_bias = empty_param(hidden, **kw) if arch.o_bias else None
        self.q_norm = empty_param(self.head_dim, **kw) if arch.qk_norm else None
        self.k_norm = empty_param(self.head_dim, **kw) if arch.qk_norm else None
        self.gate_up_weight = empty_param(2 * self.inter_size, hidden, **kw)
        self.down_weight = empty_param(hidden, self.inter_size, **kw)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, attn: AttentionFn,
                all_reduce: AllReduceFn | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: this layer's input delta, residual: the running sum (None for layer 0).

        Returns (mlp output, residual before it); their sum is the layer's output hidden state.
        """
        h, residual = add_rms_norm(x, residual, self.input_norm, self.eps)
        h = self._attention(h, cos, sin, attn, all_reduce)
        h, residual = add_rms_norm(h, residual, self.post_attn_norm, self.eps)
        return self._mlp(h, all_reduce), residual

    def _attention(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   attn: AttentionFn, all_reduce: AllReduceFn | None) -> torch.Tensor:
        n = h.shape[0]
        qkv = linear(h, self.qkv_weight, self.qkv_bias)
        kernel = (row_kernels(qkv) if self.q_norm is None and cos.dtype == qkv.dtype
                  else None)
        if kernel is not None:
            # q and k rotated in place in qkv, one pass; q, k, v stay views of it.
            kernel.rope_(qkv, cos, sin, self.num_heads + self.num_kv_heads)
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if kernel is None:
            if self.q_norm is not None:
                q = rms_norm(q, self.q_norm, self.eps)
                k = rms_norm(k, self.k_norm, self.eps)
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
            v = v.contiguous()
        o = attn(self.layer_idx, q, k, v)
        out = linear(o.reshape(n, self.q_size), self.o_weight)
        if all_reduce is not None:
            out = all_reduce(out)
        if self.o_bias is not None:
            out = out + self.o_bias
        return out

    def _mlp(self, h: torch.Tensor, all_reduce: AllReduceFn | None) -> torch.Tensor:
        gate_up = linear(h, self.gate_up_weight)
        kernel = row_kernels(gate_up) if gate_up.is_contiguous() else None
        if kernel is not None:
            # One vectorized pass into a contiguous [T, inter] (bf16: with torch's roundings):
            # the down projection's gemm (oneDNN) would copy a strided half of gate_up first.
            act = kernel.silu_mul(gate_up, self.inter_size)
        else:
            gate, up = gate_up.split((self.inter_size, self.inter_size), dim=-1)
            act = F.silu(gate, inplace=True).mul_(up)
        out = linear(act, self.down_weight)
        if all_reduce is not None:
            out = all_reduce(out)
        return out
