"""Decoder-only causal LM (Llama / Qwen2 / Qwen3) over flattened tokens of many sequences.

The model owns no KV cache and no attention kernel: every layer hands its rotated q, k, v to the
caller's `attn(layer_idx, q, k, v)`, which writes the KV cache, applies causal / paged attention
with GQA and scale `arch.attn_scale`, and returns [T, num_heads, head_dim]. That keeps the model
free of batch structure: `forward` takes token ids and positions of any mix of prefill chunks
and decode steps, concatenated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.arch import ModelArch
from engine.models.layers import AllReduceFn, AttentionFn, DecoderLayer, empty_param, rms_norm
from engine.models.linear import linear
from engine.models.rope import build_cos_sin_cache


class CausalLM(nn.Module):
    """Weights start uninitialised; `engine.models.loader.load_model` fills them from disk.

    With tensor parallelism (`tp_size` > 1) the module holds rank `tp_rank`'s attention heads and
    MLP slice; embeddings and lm_head are replicated; `all_reduce` sums row-parallel outputs.
    `num_heads` / `num_kv_heads` are the per-rank counts the attention callback sees.
    """

    def __init__(self, arch: ModelArch, dtype: torch.dtype, device: torch.device | str = "cpu",
                 tp_rank: int = 0, tp_size: int = 1,
                 all_reduce: AllReduceFn | None = None) -> None:
        super().__init__()
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise ValueError(f"invalid tensor-parallel rank {tp_rank} of {tp_size}")
        for name in ("num_heads", "num_kv_heads", "intermediate_size"):
            if getattr(arch, name) % tp_size:
                raise ValueError(f"{arch.architecture}: {name}={getattr(arch, name)} is not "
                                 f"divisible by tensor_parallel_size={tp_size}")
        if tp_size > 1 and all_reduce is None:
            raise ValueError("tensor parallelism needs an all_reduce function")
        self.arch = arch
        self.dtype = dtype
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.num_heads = arch.num_heads // tp_size
        self.num_kv_heads = arch.num_kv_heads // tp_size
        self._all_reduce = all_reduce if tp_size > 1 else None
        kw = {"dtype": dtype, "device": device}
        self.embed_tokens = empty_param(arch.vocab_size, arch.hidden_size, **kw)
        self.layers = nn.ModuleList(
            DecoderLayer(arch, i, dtype, device, tp_size) for i in range(arch.num_layers))
        self.norm = empty_param(arch.hidden_size, **kw)
        self.lm_head = (self.embed_tokens if arch.tie_word_embeddings
                        else empty_param(arch.vocab_size, arch.hidden_size, **kw))
        self.register_buffer(
            "cos_sin_cache",
            build_cos_sin_cache(arch.rope, arch.head_dim, arch.max_position_embeddings,
                                dtype, device),
            persistent=False)

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
        x = F.embedding(input_ids, self.embed_tokens)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, attn, self._all_reduce)
        return rms_norm(residual + x, self.norm, self.arch.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] (rows of forward's output) -> float32 logits [N, vocab_size]."""
        return linear(hidden, self.lm_head).float()
