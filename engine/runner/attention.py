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

Decodes (one query token) go to the compiled kernel (engine/kernels) when it is
available: it reads each sequence's K/V in place through its block table, every sequence at
its own length. Without it they are gathered with index_select and batched into padded
scaled_dot_product_attention calls, grouped by length. Float32 prefills and fresh bf16
prefills go to the compiled flash-style causal kernel (prefill_attention.cpp: GQA-aware
tiles, tiles above the diagonal skipped, fp32 accumulation, bf16's softmax weights rounded
to bf16 before P V as torch's SDPA does; 1.6x SDPA on a 1024-token fp32 prompt; bf16 on
vdpbf16ps pairs or float32 tiles, whichever engine/kernels/linear.py measured faster); other
dtypes, bf16 prefills over cached keys, and all prefills without the kernels to
scaled_dot_product_attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from engine.kernels.linear import bf16_attention_pairs


@dataclass
class SeqSpan:
    """One sequence's share of the flattened batch."""

    q_start: int  # first row of this sequence in the flattened batch
    q_len: int  # tokens computed this step
    ctx_len: int  # tokens in context after this step (computed before + q_len)
    block_ids: list[int]


class AttentionMetadata:
    """Per-step metadata, built once by the model runner and shared by every layer.

    Writes address the cache as rows of `kv_heads * head_dim` values: row
    ((block * L + layer) * 2 + kv) * bs + offset; reads copy whole chunks of `bs` rows
    (chunk (block * L + layer) * 2 + kv), which is about twice as fast as gathering rows.
    Indices are computed once per step for layer 0 and shifted per layer, so each layer does
    one write (the kernels' write_kv, else an index_copy_) and one index_select per K and V to
    read.
    """

    def __init__(self, spans: list[SeqSpan], block_size: int, num_layers: int,
                 device: torch.device, kernel: bool = False) -> None:
        self.spans = spans
        self.block_size = block_size
        self.layer_stride = 2 * block_size  # rows between layer l and l + 1 of a block
        self.block_stride = num_layers * 2 * block_size  # rows between blocks
        self.chunks_per_block = num_layers * 2  # reads copy whole chunks of bs rows
        rows = []
        for s in spans:
            start = s.ctx_len - s.q_len
            for pos in range(start, s.ctx_len):
                rows.append(s.block_ids[pos // block_size] * self.block_stride
                            + pos % block_size)
        self.write_rows = torch.tensor(rows, dtype=torch.long, device=device)
        # Decodes (q_len == 1) are batched into padded attention calls, by length.
        self.decode_spans = [s for s in spans if s.q_len == 1]
        self.prefill_spans = [s for s in spans if s.q_len > 1]
        self.decode_groups: list[DecodeGroup] = []
        self.decode_table: DecodeTable | None = None
        if kernel and self.decode_spans:
            self.decode_table = DecodeTable(self.decode_spans, block_size,
                                            self.chunks_per_block, device)
        else:
            self._build_decode_groups(device)

    def context_chunks(self, block_ids: list[int], ctx_len: int, device: torch.device
                       ) -> torch.Tensor:
        """Layer-0 K chunks (a chunk = one block's rows of one layer, K or V) holding the
        first ctx_len positions of a sequence."""
        n = (ctx_len + self.block_size - 1) // self.block_size
        blocks = torch.tensor(block_ids[:n], dtype=torch.long, device=device)
        return blocks * self.chunks_per_block

    def _build_decode_groups(self, device: torch.device) -> None:
        """Group decodes of similar length (each group's longest context at most twice its
        shortest, plus a block): padding every decode to the batch's longest context would
        make one long request multiply the KV every short one copies."""
        bs = self.block_size
        order = sorted(self.decode_spans, key=lambda s: s.ctx_len)
        group: list[SeqSpan] = []
        for s in order:
            if group and s.ctx_len > 2 * group[0].ctx_len + bs:
                self.decode_groups.append(DecodeGroup(group, bs, self.chunks_per_block, device))
                group = []
            group.append(s)
        if group:
            self.decode_groups.append(DecodeGroup(group, bs, self.chunks_per_block, device))


def _chunk_table(spans: list[SeqSpan], bs: int, chunks_per_block: int,
                 device: torch.device) -> torch.Tensor:
    """[B, max_blocks] layer-0 K chunks of each sequence's context blocks (0-padded)."""
    ns = [(s.ctx_len + bs - 1) // bs for s in spans]
    width = max(ns)
    # one tensor from padded lists: a torch.tensor and a slice copy per sequence cost ~10 us
    # each, ~0.3 ms of a batch-32 decode step
    rows = [[*s.block_ids[:n], *([0] * (width - n))] for s, n in zip(spans, ns, strict=True)]
    return torch.tensor(rows, dtype=torch.long).mul_(chunks_per_block).to(device)


class DecodeTable:
    """Every decode of the step, for the compiled kernel: block table, rows and lengths."""

    def __init__(self, spans: list[SeqSpan], bs: int, chunks_per_block: int,
                 device: torch.device) -> None:
        self.chunks = _chunk_table(spans, bs, chunks_per_block, device)
        self.rows = torch.tensor([s.q_start for s in spans], dtype=torch.long, device=device)
        self.ctx = torch.tensor([s.ctx_len for s in spans], dtype=torch.long, device=device)


class DecodeGroup:
    """Decodes batched into one padded attention call."""

    def __init__(self, spans: list[SeqSpan], bs: int, chunks_per_block: int,
                 device: torch.device) -> None:
        self.chunks = _chunk_table(spans, bs, chunks_per_block, device)
        max_blocks = self.chunks.shape[1]
        lens = [s.ctx_len for s in spans]
        self.ctx = lens[0] if len(set(lens)) == 1 else None  # all equal: slice, no mask
        ctx = torch.tensor(lens, device=device)
        keys = torch.arange(max_blocks * bs, device=device)
        # [B, 1, 1, S]: True where the key is inside the sequence's context.
        self.mask = (keys[None, :] < ctx[:, None])[:, None, None, :]
        self.rows = torch.tensor([s.q_start for s in spans], device=device)


class PagedAttention:
    """Callable the model invokes per layer: `attn(layer_idx, q, k, v) -> out`."""

    def __init__(self, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                 kernel: ModuleType | None = None) -> None:
        self.kv_cache = kv_cache
        self.kernel = kernel
        self.rows = kv_cache.view(-1, kv_cache.shape[-2] * kv_cache.shape[-1])
        self.chunks = kv_cache.view(-1, kv_cache[0, 0, 0].numel())
        self.block_view = kv_cache.view(-1, *kv_cache.shape[-3:])  # [chunks, bs, KV, D]
        self.kv_heads, self.head_dim = kv_cache.shape[-2], kv_cache.shape[-1]
        self.meta = meta
        self.scale = scale

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> torch.Tensor:
        m = self.meta
        self._write(layer, k, v)
        # The kernels write float32 rows; the torch paths rows of q's dtype.
        out = torch.empty(q.shape, dtype=torch.float32 if self.kernel is not None else q.dtype,
                          device=q.device)
        if m.decode_table is not None and self.kernel is not None:
            t = m.decode_table
            self.kernel.paged_decode(out, q.float().contiguous(), self.block_view, t.chunks,
                                     t.rows, t.ctx, layer, self.scale)
        for s in m.prefill_spans:
            self._prefill(layer, s, q, k, v, out[s.q_start:s.q_start + s.q_len])
        for g in m.decode_groups:
            out[g.rows] = self._decode(layer, g, q[g.rows]).to(out.dtype)
        return out.to(q.dtype)

    def decode_only(self) -> tuple | None:
        """Where this step holds only decodes and they go to the compiled kernel: what every
        layer's write_kv and paged_decode share, in DecodeStack.set_step's order after cos and
        sin (kv rows, write rows, layer stride, block size, chunks, table, rows, lengths,
        scale); else None."""
        m = self.meta
        if self.kernel is None or m.decode_table is None or m.prefill_spans or m.decode_groups:
            return None
        t = m.decode_table
        return (self.rows, m.write_rows, m.layer_stride, m.block_size, self.block_view,
                t.chunks, t.rows, t.ctx, self.scale)

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """This step's K and V into their cache slots (one kernel call, or two cats and an
        index_copy_)."""
        m, t, dtype = self.meta, k.shape[0], self.rows.dtype
        k, v = k.reshape(t, -1).to(dtype), v.reshape(t, -1).to(dtype)
        if self.kernel is not None:
            self.kernel.write_kv(self.rows, m.write_rows, layer * m.layer_stride, m.block_size,
                                 k, v)  # rows of any stride (views of the q|k|v output)
            return
        write = m.write_rows + layer * m.layer_stride
        self.rows.index_copy_(0, torch.cat((write, write + m.block_size)), torch.cat((k, v)))

    def _read(self, chunks: torch.Tensor, layer: int, dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given layer-0 K chunks ([..., n]) → [..., n * bs, KV, D] each."""
        shape = (*chunks.shape[:-1], -1, self.kv_heads, self.head_dim)
        idx = chunks.reshape(-1) + 2 * layer
        k = self.chunks.index_select(0, idx).view(shape)
        v = self.chunks.index_select(0, idx + 1).view(shape)
        return k.to(dtype), v.to(dtype)

    def _prefill(self, layer: int, s: SeqSpan, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, out: torch.Tensor) -> None:
        """Causal attention of one sequence's q_len queries into `out` (its rows)."""
        rows = slice(s.q_start, s.q_start + s.q_len)
        start = s.ctx_len - s.q_len
        if start == 0:
            # Fresh prefill: the keys are exactly this chunk's own, no cache read needed.
            ks, vs = k[rows], v[rows]
        else:
            chunks = self.meta.context_chunks(s.block_ids, s.ctx_len, q.device)
            ks, vs = self._read(chunks, layer, q.dtype)
            ks, vs = ks[:s.ctx_len], vs[:s.ctx_len]
        # bf16 prefills over cached keys (a later chunk, a prefix hit) stay on SDPA. The
        # kernel rounds like SDPA at its 512-key blocks (2% of the outputs differ by an ulp of
        # summation order, test_paged_attention), yet SmolLM2's bf16 chat answer in P/D flips
        # on that much after a prefix hit on P (test_pd_real_model chat[bfloat16] fails in the
        # module's order, passes alone). Fresh bf16 prefills and every fp32 prefill take the
        # kernel.
        bf16_fresh = q.dtype == torch.bfloat16 and start == 0
        if self.kernel is not None and (q.dtype == torch.float32 or bf16_fresh):
            self.kernel.prefill_attention(out, q[rows], ks, vs, self.scale,
                                          not bf16_fresh or bf16_attention_pairs())
            return
        mask = None
        if start:
            qpos = torch.arange(start, s.ctx_len, device=q.device)
            kpos = torch.arange(s.ctx_len, device=q.device)
            mask = kpos[None, :] <= qpos[:, None]
        o = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1).unsqueeze(0), ks.transpose(0, 1).unsqueeze(0),
            vs.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=mask is None,
            scale=self.scale, enable_gqa=True,
        )
        out.copy_(o.squeeze(0).transpose(0, 1))

    def _decode(self, layer: int, g: DecodeGroup, q: torch.Tensor) -> torch.Tensor:
        k, v = self._read(g.chunks, layer, q.dtype)  # [B, S, KV, D]
        mask = g.mask
        if g.ctx is not None:
            k, v, mask = k[:, :g.ctx], v[:, :g.ctx], None
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
            scale=self.scale, enable_gqa=True,
        )  # [B, H, 1, D]
        return o.squeeze(2)
