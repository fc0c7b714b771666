"""Decoder-only causal LM (Llama / Qwen2 / Qwen3) over flattened tokens of many sequences.

The model owns no KV cache and no attention kernel: every layer hands its rotated q, k, v to the
caller's `attn(layer_idx, q, k, v)`, which writes the KV cache, applies causal / paged attention
with GQA and scale `arch.attn_scale`, and returns [T, num_heads, head_dim]. That keeps the model
free of batch structure: `forward` takes token ids and positions of any mix of prefill chunks
and decode steps, concatenated.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from engine.kernels.linear import linear, row_kernels, skinny_kernel
from engine.models.arch import ModelArch
from engine.models.layers import AttentionFn, DecoderLayer, add_rms_norm, empty_param
from engine.models.parallel import (
    Collectives,
    TPLayout,
    gather_argmax,
    gather_logits,
    vocab_parallel_embedding,
)
from engine.models.rope import build_cos_sin_cache

STACK_ENV = "PDSERVE_DECODE_STACK"  # "1" (default) or "0": the Python layers every step


def decode_stack_enabled() -> bool:
    """Whether decode-only steps may take the compiled DecodeStack (PDSERVE_DECODE_STACK=0 is
    the escape hatch and the A/B switch); another value is an error naming it."""
    value = os.environ.get(STACK_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{STACK_ENV}={value!r}: expected '1' (the default) or '0'")
    return value == "1"


class CausalLM(nn.Module):
    """Weights start uninitialised; `engine.models.loader.load_model` fills them from disk.

    With tensor parallelism (`tp_size` > 1) the module holds rank `tp_rank`'s share
    (engine.models.parallel: heads, MLP slice, vocabulary rows) and `comm` carries the
    all-reduce / all-gather across ranks. `num_heads` / `num_kv_heads` are the per-rank counts
    the attention callback sees.
    """

    def __init__(self, arch: ModelArch, dtype: torch.dtype, device: torch.device | str = "cpu",
                 tp_rank: int = 0, tp_size: int = 1,
                 comm: Collectives | None = None) -> None:
        super().__init__()
        self.layout = TPLayout.of(arch, tp_rank, tp_size)
        if tp_size > 1 and comm is None:
            raise ValueError("tensor parallelism needs collectives (all_reduce, all_gather)")
        self.arch = arch
        self.dtype = dtype
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.num_heads = self.layout.num_heads
        self.num_kv_heads = self.layout.num_kv_heads
        self.comm = comm if tp_size > 1 else None
        kw = {"dtype": dtype, "device": device}
        rows = self.layout.vocab_rows
        self.embed_tokens = empty_param(rows, arch.hidden_size, **kw)
        self.layers = nn.ModuleList(
            DecoderLayer(arch, i, dtype, device, self.layout) for i in range(arch.num_layers))
        self.norm = empty_param(arch.hidden_size, **kw)
        self.lm_head = (self.embed_tokens if arch.tie_word_embeddings
                        else empty_param(rows, arch.hidden_size, **kw))
        self.register_buffer(
            "cos_sin_cache",
            build_cos_sin_cache(arch.rope, arch.head_dim, arch.max_position_embeddings,
                                dtype, device),
            persistent=False)
        self._stack: Any = None  # the compiled DecodeStack, built on the first decode step
        self._stack_on = decode_stack_enabled()

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionFn) -> torch.Tensor:
        """input_ids, positions: LongTensor [T]. Returns the final-normed hidden states [T, H].

        Positions must lie in [0, max_position_embeddings). Calls attn once per layer, in order.
        """
        cos_sin = self.cos_sin_cache.index_select(0, positions)
        half = self.arch.head_dim // 2
        cos = cos_sin[:, None, :half]
        sin = cos_sin[:, None, half:]
        x = vocab_parallel_embedding(input_ids, self.embed_tokens, self.layout, self.comm)
        stack = self._decode_stack(attn, x, cos, sin)
        if stack is not None:
            x, residual = self._run_stack(stack, x)
        else:
            residual = None
            reduce = None if self.comm is None else self.comm.all_reduce
            for layer in self.layers:
                x, residual = layer(x, residual, cos, sin, attn, reduce)
        return add_rms_norm(x, residual, self.norm, self.arch.rms_norm_eps)[0]

    def _decode_stack(self, attn: AttentionFn, x: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> Any:
        """The compiled DecodeStack (decode_stack.cpp) set up for this step, where the step
        holds only decodes for the paged kernel and every layer would run exactly the kernels
        it runs (skinny matmuls at these rows, the rope, norm and activation kernels); else
        None. It is built once, on the layers' own weight tensors."""
        decode_only = getattr(attn, "decode_only", None) if self._stack_on else None
        step = decode_only() if decode_only is not None else None
        if (step is None or self.arch.qk_norm or cos.dtype != x.dtype
                or row_kernels(x) is None):
            return None
        kernel = skinny_kernel(x.dtype, x.shape[0])
        if kernel is None:
            return None
        if self._stack is None:
            ls = self.layers
            self._stack = kernel.DecodeStack(
                [la.input_norm for la in ls], [la.qkv_weight for la in ls],
                [la.qkv_bias for la in ls if la.qkv_bias is not None],
                [la.o_weight for la in ls], [la.o_bias for la in ls if la.o_bias is not None],
                [la.post_attn_norm for la in ls], [la.gate_up_weight for la in ls],
                [la.down_weight for la in ls], self.num_heads, self.num_kv_heads,
                self.arch.head_dim, self.layout.intermediate_size, self.arch.rms_norm_eps)
        self._stack.set_step(cos, sin, *step)
        return self._stack

    def _run_stack(self, stack: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer on the DecodeStack: one call without tensor parallelism, else each
        layer's two halves with the all-reduces between them (as DecoderLayer.forward)."""
        if self.comm is None:
            return stack.run(x)
        residual = None
        for i in range(len(self.layers)):
            o, residual = stack.attention(i, x, residual)
            x, residual = stack.mlp(i, self.comm.all_reduce(o), residual)
            x = self.comm.all_reduce(x)
        return x, residual

    def layer_gemm_shapes(self) -> list[tuple[int, int]]:
        """[out, in] of a decoder layer's matmul weights (every layer's are the same; a TP
        rank's shard)."""
        if not self.layers:
            return []
        layer = self.layers[0]
        return [(int(w.shape[0]), int(w.shape[1])) for w in (
            layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight)]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] (rows of forward's output) -> float32 logits [N, vocab_size]."""
        return gather_logits(linear(hidden, self.lm_head).float(), self.layout, self.comm)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> int64 [N], argmax(compute_logits(hidden)) to the bit; under TP
        without gathering the logits (`gather_argmax`: each rank's argmax, then [N, 2])."""
        return gather_argmax(linear(hidden, self.lm_head).float(), self.layout, self.comm)
