"""Paged attention: the compiled decode and prefill kernels and the torch path against a dense
reference.

The reference gathers each sequence's K/V from its (shuffled, non-contiguous) blocks by hand and
runs plain softmax attention in float64, so both paths are checked against the definition, not
against each other.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.runner.attention import AttentionMetadata, PagedAttention, SeqSpan

BS, LAYERS, KV, GROUP, DIM = 16, 3, 2, 3, 32
HEADS = KV * GROUP


def _case(seed: int, lens: list[tuple[int, int]], dtype: torch.dtype):
    """lens: (q_len, ctx_len) per sequence. Returns cache, q, k, v, spans."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    need = sum((c + BS - 1) // BS for _, c in lens)
    ids = list(range(need + 5))
    rng.shuffle(ids)
    cache = torch.randn(need + 5, LAYERS, 2, BS, KV, DIM).to(dtype)
    spans, start = [], 0
    for q_len, ctx in lens:
        n = (ctx + BS - 1) // BS
        spans.append(SeqSpan(start, q_len, ctx, [ids.pop() for _ in range(n)]))
        start += q_len
    q = torch.randn(start, HEADS, DIM).to(dtype)
    k = torch.randn(start, KV, DIM).to(dtype)
    v = torch.randn(start, KV, DIM).to(dtype)
    return cache, q, k, v, spans


def _reference(cache, layer, q, k, v, spans):
    """Writes this step's K/V at their slots, then dense causal attention per sequence."""
    cache = cache.clone()
    out = torch.empty(q.shape, dtype=torch.float64)
    for s in spans:
        first = s.ctx_len - s.q_len
        for i in range(s.q_len):
            pos = first + i
            blk, off = s.block_ids[pos // BS], pos % BS
            cache[blk, layer, 0, off] = k[s.q_start + i]
            cache[blk, layer, 1, off] = v[s.q_start + i]
        ks = torch.cat([cache[b, layer, 0] for b in s.block_ids])[:s.ctx_len].double()
        vs = torch.cat([cache[b, layer, 1] for b in s.block_ids])[:s.ctx_len].double()
        for i in range(s.q_len):
            pos = first + i
            for h in range(HEADS):
                qh = q[s.q_start + i, h].double()
                scores = ks[:pos + 1, h // GROUP] @ qh * DIM ** -0.5
                out[s.q_start + i, h] = torch.softmax(scores, 0) @ vs[:pos + 1, h // GROUP]
    return out


LENS = [(1, 1), (1, 17), (5, 40), (1, 300), (1, 16), (12, 12), (1, 33), (1, 2)]


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                                 ids=["fp32", "bf16", "fp16"])


@DTYPES
def test_kernel_matches_dense_reference_on_every_isa_path(kernel_isa, dtype):
    """kernel_isa: forced onto each instruction-set path this CPU has (tests/conftest.py)."""
    _check(kernel_isa, dtype)


@DTYPES
def test_torch_path_matches_dense_reference(dtype):
    _check(None, dtype)


@DTYPES
def test_long_prefills_match_dense_reference_on_every_isa_path(kernel_isa, dtype):
    """The prefill kernel over several 128-key tiles and query blocks: a fresh prefill, later
    chunks (queries from position 130; from 120, a block straddling the tile at 128, whose
    first rows see none of that tile's keys), beside a decode; q, k and v are views of one
    fused q|k|v tensor (strided rows), as the model passes them."""
    _check(kernel_isa, dtype, [(300, 300), (70, 200), (40, 160), (1, 90)], seeds=1, fused=True)


def test_a_peaked_softmax_matches_and_leaves_the_callers_denormals_alone(kernel_isa):
    """Scores spread ~20 wide: many softmax weights sit near e^-87 and their products with V
    are denormal, which the kernels flush to zero (simd.h FlushDenormals: each would cost a
    microcode assist); the outputs still match the definition, and the calling thread's
    floating-point mode is restored: torch keeps its denormals after the call."""
    tiny = torch.tensor([1e-39])
    assert (tiny * 0.5).item() != 0.0  # denormals live here before the call
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # the kernels' work runs on this thread
        _check(kernel_isa, torch.float32, [(200, 200), (1, 300), (3, 40)], seeds=1, peak=20.0)
    finally:
        torch.set_num_threads(threads)
    assert (tiny * 0.5).item() != 0.0


def _fused_views(q, k, v):
    t = q.shape[0]
    qkv = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), 1)
    q_, k_, v_ = qkv.split((q[0].numel(), k[0].numel(), v[0].numel()), 1)
    return q_.view(q.shape), k_.view(k.shape), v_.view(v.shape)


def _check(kernel, dtype, lens=LENS, seeds=3, fused=False, peak=1.0):
    use_kernel = kernel is not None
    for seed in range(seeds):
        cache, q, k, v, spans = _case(seed, lens, dtype)
        q = q * peak
        if fused:
            q, k, v = _fused_views(q, k, v)
        layer = seed % LAYERS
        meta = AttentionMetadata(spans, BS, LAYERS, torch.device("cpu"), kernel=use_kernel)
        assert (meta.decode_table is not None) == use_kernel
        want = _reference(cache, layer, q, k, v, spans)
        got = PagedAttention(cache, meta, DIM ** -0.5, kernel)(layer, q, k, v)
        assert got.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 2e-2 if dtype == torch.bfloat16 else 2e-3
        tol *= peak  # scores `peak` times larger: their float32 rounding errors too
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("pairs", [True, False], ids=["pairs", "float-tiles"])
@pytest.mark.parametrize(("tokens", "keys"), [(700, 700), (300, 1100)],
                         ids=["fresh", "over-cached-keys"])
def test_bf16_prefill_rounds_like_torch_sdpa(kernel_isa, tokens, keys, pairs):
    """bf16 prefill attention against torch's SDPA (CPU flash attention, what transformers
    runs) over several of its 512-key blocks: the softmax weights are rounded to bf16 at the
    same running maxima, so the outputs agree to the last bf16 bit but for summation order
    (with 128-key tiles ~10 % of the values differed). Both layouts on avx512_bf16: vdpbf16ps
    pairs and float32 tiles (bf16_pairs=False: the avx512 path's tiles, the same bits)."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(tokens + keys)
    heads, kv, dim = 8, 4, 64
    q = (torch.randn(tokens, heads, dim, generator=gen) * 2).bfloat16()
    k = (torch.randn(keys, kv, dim, generator=gen) * 2).bfloat16()
    v = torch.randn(keys, kv, dim, generator=gen).bfloat16()
    out = torch.empty(tokens, heads, dim)
    kernel_isa.prefill_attention(out, q, k, v, dim ** -0.5, pairs)
    if not pairs and kernel_isa.get_isa() == "avx512_bf16":
        tiles = torch.empty(tokens, heads, dim)
        kernel_isa.set_isa("avx512")
        kernel_isa.prefill_attention(tiles, q, k, v, dim ** -0.5)
        kernel_isa.set_isa("avx512_bf16")
        assert torch.equal(out, tiles)
    start = keys - tokens
    mask = (torch.arange(keys)[None, :] <= torch.arange(start, keys)[:, None]) if start else None
    want = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, is_causal=mask is None, scale=dim ** -0.5, enable_gqa=True,
    )[0].transpose(0, 1)
    got = out.bfloat16()
    differ = (got != want).float().mean().item()
    assert differ < 0.05, f"{differ:.1%} of the bf16 outputs differ from SDPA's"
    assert (got.float() - want.float()).abs().max().item() <= 2 ** -6  # one ulp at [2, 4)


@pytest.mark.parametrize(("heads", "kv"), [(4, 4), (8, 2)], ids=["mha", "gqa4"])
def test_prefill_split_over_threads_changes_nothing(kernel_isa, heads, kv):
    """The work items are cut into one run per thread by their work: every thread count gives
    the same bits (no item dropped or done twice; each output row is computed by one item
    whatever the cut), and the result matches the float64 definition (group 1 included,
    where a 6-row group spans 6 positions of the diagonal)."""
    gen = torch.Generator().manual_seed(heads + kv)
    tokens, dim = 333, 32
    q = torch.randn(tokens, heads, dim, generator=gen)
    k = torch.randn(tokens, kv, dim, generator=gen)
    v = torch.randn(tokens, kv, dim, generator=gen)
    threads = torch.get_num_threads()
    outs = []
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            out = torch.full((tokens, heads, dim), float("nan"))
            kernel_isa.prefill_attention(out, q, k, v, dim ** -0.5)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    g = heads // kv
    s = torch.einsum("thd,shd->hts", q.double(), k.double().repeat_interleave(g, 1)) * dim ** -0.5
    s = s.masked_fill(torch.ones(tokens, tokens, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("hts,shd->thd", s.softmax(-1), v.double().repeat_interleave(g, 1))
    torch.testing.assert_close(outs[0].double(), want, atol=1e-5, rtol=1e-5)


@DTYPES
def test_long_decodes_cut_into_parts_match_dense_reference(kernel_isa, dtype):
    """Decode contexts over 512 positions are cut into items of 512 (whole blocks), computed
    apart and combined; at and around the cut, and one of three items, beside short ones."""
    _check(kernel_isa, dtype, [(1, 1100), (1, 513), (1, 512), (3, 20), (1, 1)], seeds=1)


def test_decode_gives_the_same_bits_alone_in_a_batch_and_on_any_threads(kernel_isa):
    """A sequence's items depend only on its length, so its output does too: decoded alone or
    beside others, on 1, 2 or 3 threads (the runs cut elsewhere), the same bits."""
    cache, q, _, _, spans = _case(7, [(1, 1100), (1, 40), (1, 600), (1, 513)], torch.float32)
    meta = AttentionMetadata(spans, BS, LAYERS, torch.device("cpu"), kernel=True)
    t, view = meta.decode_table, cache.view(-1, BS, KV, DIM)

    def decode(idx: list[int], threads: int) -> torch.Tensor:
        out = torch.full(q.shape, float("nan"))
        torch.set_num_threads(threads)
        kernel_isa.paged_decode(out, q, view, t.chunks[idx], t.rows[idx], t.ctx[idx], 1,
                                DIM ** -0.5)
        return out

    threads = torch.get_num_threads()
    try:
        together = [decode([0, 1, 2, 3], n) for n in (1, 2, 3)]
        alone = [decode([i], 1)[i] for i in range(4)]
    finally:
        torch.set_num_threads(threads)
    assert not together[0].isnan().any()
    for out in together[1:]:
        assert torch.equal(out, together[0])
    for i, row in enumerate(alone):
        assert torch.equal(row, together[0][i])


@pytest.mark.parametrize(("entry", "ctx", "what"), [
    (-1, 5, "block table entry out of range"),  # the cache's last chunk: its V lies past it
    (-2 * LAYERS, 5, "block table entry out of range"),
    (0, BS + 1, "bad context length"),  # one block in the table, a context of two
], ids=["past-end", "negative", "context-past-table"])
def test_decode_rejects_a_table_that_reads_outside_the_cache(kernel_isa, entry, ctx, what):
    """A block table entry or context length that would read outside the cache (or the table)
    is an error naming it, not a read of other memory."""
    view = torch.zeros(4, LAYERS, 2, BS, KV, DIM).view(-1, BS, KV, DIM)
    entry = entry % view.shape[0] if entry == -1 else entry
    q = torch.zeros(1, HEADS, DIM)
    with pytest.raises(RuntimeError, match=what):
        kernel_isa.paged_decode(torch.empty_like(q), q, view, torch.tensor([[entry]]),
                                torch.tensor([0]), torch.tensor([ctx]), 0, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("group", "dim"), [(2, 64), (3, 64), (3, 32), (4, 128)])
def test_grouped_heads_give_the_bits_of_each_head_over_its_own_kv_copy(kernel_isa, dtype,
                                                                       group, dim):
    """With bf16 rows two query heads of a group share each K and V load (kPairs), and float32
    rows on the 16-lane path take V several kv heads a pass (weigh_span: here groups of 2 over
    64 values, and the copies' groups of 1 over 64 and 128, 3 x 64 with kv heads left over);
    every head's sums keep their order, so a GQA decode equals, bit for bit, the same heads
    each over its own copy of its kv head (group 1: one head at a time), and both match the
    float64 definition."""
    kv = 2
    gen = torch.Generator().manual_seed(group * dim)
    lens = [1100, 40, 17, 16, 1]
    nblocks = sum(-(-n // BS) for n in lens)
    ids = torch.randperm(nblocks, generator=gen).tolist()
    spans = []
    for i, n in enumerate(lens):
        spans.append(SeqSpan(i, 1, n, [ids.pop() for _ in range(-(-n // BS))]))
    cache = torch.randn(nblocks, LAYERS, 2, BS, kv, dim, generator=gen).to(dtype)
    q = torch.randn(len(lens), kv * group, dim, generator=gen)
    meta = AttentionMetadata(spans, BS, LAYERS, torch.device("cpu"), kernel=True)
    t = meta.decode_table

    def decode(c: torch.Tensor) -> torch.Tensor:
        out = torch.full(q.shape, float("nan"))
        kernel_isa.paged_decode(out, q, c.view(-1, BS, c.shape[-2], dim), t.chunks, t.rows,
                                t.ctx, 1, dim ** -0.5)
        return out

    grouped = decode(cache)
    own = decode(cache.repeat_interleave(group, dim=4).contiguous())
    assert not grouped.isnan().any()
    assert torch.equal(grouped, own)
    want = torch.empty(q.shape, dtype=torch.float64)
    for b, s in enumerate(spans):
        ks, vs = (torch.cat([cache[i, 1, kv_] for i in s.block_ids])[:s.ctx_len].double()
                  .repeat_interleave(group, dim=1) for kv_ in (0, 1))
        p = torch.softmax(torch.einsum("hd,thd->ht", q[b].double(), ks) * dim ** -0.5, -1)
        want[b] = torch.einsum("ht,thd->hd", p, vs)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(grouped.double(), want, atol=tol, rtol=tol)
