"""Paged attention over the engine's KV cache, for flattened batches of many sequences.

KV cache layout (one tensor per engine):

    kv_cache[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

so one block — every layer, K and V — is ONE contiguous byte range, and a run of
consecutive block ids is one contiguous range. A KV transfer of n blocks therefore needs
one NIXL descriptor per run of consecutive block ids (at best 1, at worst n), whatever
the number of layers.

Each step, every token's K/V is first written at its slot (block_ids[pos // bs], pos % bs);
then each sequence's queries attend over its whole context read back through its block
table. A query at absolute position p sees keys at positions <= p: that single rule is
right for fresh prefills, later prefill chunks and prefix-cache hits alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class SeqSpan:
    """One sequence's share of the flattened batch."""

    q_start: int  # first row of this sequence in the flattened batch
    q_len: int  # tokens computed this step
    ctx_len: int  # tokens in context after this step (computed before + q_len)
    block_ids: list[int]


class AttentionMetadata:
    """Per-step metadata, built once by the model runner and shared by every layer."""

    def __init__(self, spans: list[SeqSpan], block_size: int, device: torch.device) -> None:
        self.spans = spans
        self.block_size = block_size
        blocks, offsets = [], []
        for s in spans:
            start = s.ctx_len - s.q_len
            for pos in range(start, s.ctx_len):
                blocks.append(s.block_ids[pos // block_size])
                offsets.append(pos % block_size)
        self.slot_blocks = torch.tensor(blocks, dtype=torch.long, device=device)
        self.slot_offsets = torch.tensor(offsets, dtype=torch.long, device=device)
        # Decodes (q_len == 1) are batched into one padded attention call.
        self.decode_spans = [s for s in spans if s.q_len == 1]
        self.prefill_spans = [s for s in spans if s.q_len > 1]
        self._build_decode_tables(device)

    def _build_decode_tables(self, device: torch.device) -> None:
        spans = self.decode_spans
        if not spans:
            return
        bs = self.block_size
        max_blocks = max((s.ctx_len + bs - 1) // bs for s in spans)
        table = torch.zeros(len(spans), max_blocks, dtype=torch.long)
        for i, s in enumerate(spans):
            n = (s.ctx_len + bs - 1) // bs
            table[i, :n] = torch.tensor(s.block_ids[:n], dtype=torch.long)
        self.decode_table = table.to(device)
        ctx = torch.tensor([s.ctx_len for s in spans], device=device)
        keys = torch.arange(max_blocks * bs, device=device)
        # [B, 1, 1, S]: True where the key is inside the sequence's context.
        self.decode_mask = (keys[None, :] < ctx[:, None])[:, None, None, :]
        self.decode_rows = torch.tensor([s.q_start for s in spans], device=device)


class PagedAttention:
    """Callable the model invokes per layer: `attn(layer_idx, q, k, v) -> out`."""

    def __init__(self, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> None:
        self.kv_cache = kv_cache
        self.meta = meta
        self.scale = scale

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> torch.Tensor:
        m = self.meta
        cache = self.kv_cache
        cache[m.slot_blocks, layer, 0, m.slot_offsets] = k.to(cache.dtype)
        cache[m.slot_blocks, layer, 1, m.slot_offsets] = v.to(cache.dtype)
        out = torch.empty_like(q)
        for s in m.prefill_spans:
            out[s.q_start:s.q_start + s.q_len] = self._prefill(layer, s, q, k, v)
        if m.decode_spans:
            out[m.decode_rows] = self._decode(layer, q[m.decode_rows])
        return out

    def _prefill(self, layer: int, s: SeqSpan, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        rows = slice(s.q_start, s.q_start + s.q_len)
        qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        start = s.ctx_len - s.q_len
        if start == 0:
            # Fresh prefill: the keys are exactly this chunk's own, no cache read needed.
            ks, vs = k[rows], v[rows]
            mask, causal = None, True
        else:
            ks, vs = self._gather(layer, s.block_ids, s.ctx_len)
            qpos = torch.arange(start, s.ctx_len, device=q.device)
            kpos = torch.arange(s.ctx_len, device=q.device)
            mask, causal = (kpos[None, :] <= qpos[:, None]), False
        o = F.scaled_dot_product_attention(
            qs, ks.transpose(0, 1).unsqueeze(0).to(q.dtype),
            vs.transpose(0, 1).unsqueeze(0).to(q.dtype),
            attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=True,
        )
        return o.squeeze(0).transpose(0, 1)

    def _gather(self, layer: int, block_ids: list[int], ctx_len: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        bs = self.meta.block_size
        n = (ctx_len + bs - 1) // bs
        idx = torch.tensor(block_ids[:n], dtype=torch.long, device=self.kv_cache.device)
        kv = self.kv_cache[idx, layer]  # [n, 2, bs, KV, D]
        kv = kv.transpose(0, 1).reshape(2, n * bs, *kv.shape[-2:])[:, :ctx_len]
        return kv[0], kv[1]

    def _decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        m = self.meta
        kv = self.kv_cache[m.decode_table, layer]  # [B, nb, 2, bs, KV, D]
        b, nb, _, bs, nkv, d = kv.shape
        kv = kv.permute(2, 0, 4, 1, 3, 5).reshape(2, b, nkv, nb * bs, d).to(q.dtype)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), kv[0], kv[1], attn_mask=m.decode_mask, scale=self.scale,
            enable_gqa=True,
        )  # [B, H, 1, D]
        return o.squeeze(2)
