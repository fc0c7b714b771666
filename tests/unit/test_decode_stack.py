"""The compiled DecodeStack (engine/kernels/decode_stack.cpp) against the Python layers it
replaces: the same kernels in the same order, so a decode-only step's hidden states and the
KV it writes are bit-identical either way, on every instruction-set path, in float32 and
bf16, with q|k|v biases (qwen2) and without (llama), alone and with tensor parallelism's two
halves per layer. Where a layer would run other code (q/k norms: qwen3; a prefill in the
step; more rows than the skinny kernel takes) the stack is not used."""

from __future__ import annotations

import random

import pytest
import torch

from engine.kernels import linear as kernel_linear
from engine.models.loader import load_model
from engine.models.parallel import Collectives
from engine.runner.attention import AttentionMetadata, PagedAttention, SeqSpan

BS = 16


def _case(model, seed: int, lens: list[int]):
    """A KV cache holding random K/V for sequences of the given context lengths on shuffled
    blocks, and one decode step of them: (cache, spans, token ids, positions)."""
    a, rng = model.arch, random.Random(seed)
    need = sum(-(-(n + 1) // BS) for n in lens)
    ids = list(range(need + 3))
    rng.shuffle(ids)
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(need + 3, a.num_layers, 2, BS, model.num_kv_heads, a.head_dim,
                        generator=gen).to(model.dtype)
    spans = [SeqSpan(i, 1, n + 1, [ids.pop() for _ in range(-(-(n + 1) // BS))])
             for i, n in enumerate(lens)]
    tokens = torch.tensor([rng.randrange(a.vocab_size) for _ in lens])
    return cache, spans, tokens, torch.tensor(lens)


def _forward(model, cache, spans, tokens, positions, kernel, stack: bool):
    """The model's hidden states for one step on a copy of `cache` (and that copy), with the
    DecodeStack or with the Python layers."""
    cache = cache.clone()
    meta = AttentionMetadata(spans, BS, model.arch.num_layers, torch.device("cpu"),
                             kernel=True)
    attn = PagedAttention(cache, meta, model.arch.head_dim ** -0.5, kernel)
    used = []
    real = type(model)._decode_stack

    def spy(*args):
        got = real(model, *args) if stack else None
        used.append(got is not None)
        return got

    model._decode_stack = spy
    try:
        return model(tokens, positions, attn), cache, used[0]
    finally:
        del model._decode_stack


@pytest.fixture
def skinny_up_to_8_rows(monkeypatch):
    """The skinny kernel for up to 8 rows (these cases' most), whatever this machine's
    calibration chose: the stack runs only there. A threshold measured while CI ran came out
    at 4 rows for bf16 on the forced AVX2 path, oneDNN keeping AVX512-BF16."""
    monkeypatch.setattr(kernel_linear, "skinny_rows", lambda dtype: 8)
    monkeypatch.setattr(kernel_linear, "_skinny", {})


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_stack_gives_the_python_layers_bits(kernel_isa, tiny_models, arch, dtype,
                                                skinny_up_to_8_rows):
    model = load_model(tiny_models[arch], dtype=dtype)
    for seed, lens in enumerate([[5], [17, 40, 3], [100, 1, 64, 33, 7, 250, 16, 80]]):
        case = _case(model, seed, lens)
        want, want_cache, used = _forward(model, *case, kernel_isa, stack=False)
        got, got_cache, used_stack = _forward(model, *case, kernel_isa, stack=True)
        assert not used and used_stack
        assert torch.equal(got, want), (arch, dtype, lens)
        assert torch.equal(got_cache, want_cache)  # the step's K and V written alike


def test_tensor_parallel_halves_give_the_same_bits(tiny_models):
    """_run_stack's TP branch (each layer's attention and MLP halves, the all-reduces between
    them in Python), with a 1-rank all-reduce that returns its input: the same bits as one
    `run` and as the Python layers."""
    from engine.kernels import compiled

    model = load_model(tiny_models["qwen2"], dtype="float32")  # biases on q|k|v
    kernel = compiled()
    case = _case(model, 7, [30, 9, 61])
    want, _, _ = _forward(model, *case, kernel, stack=False)
    one, _, _ = _forward(model, *case, kernel, stack=True)
    model.comm = Collectives(all_reduce=lambda t: t, all_gather=lambda t: t)
    try:
        halves, _, used = _forward(model, *case, kernel, stack=True)
    finally:
        model.comm = None
    assert used and torch.equal(one, want) and torch.equal(halves, want)


def test_the_stack_is_not_used_where_a_layer_runs_other_code(tiny_models):
    from engine.kernels import compiled

    kernel = compiled()
    qwen3 = load_model(tiny_models["qwen3"], dtype="float32")  # q and k norms
    assert not _forward(qwen3, *_case(qwen3, 1, [20, 4]), kernel, stack=True)[2]
    model = load_model(tiny_models["llama"], dtype="float32")
    cache, spans, tokens, positions = _case(model, 2, [20, 4])
    # a prefill of 3 tokens in the same step
    spans.append(SeqSpan(2, 3, 3, [cache.shape[0] - 1]))
    tokens, positions = torch.cat((tokens, tokens[:1].repeat(3))), torch.cat(
        (positions, torch.arange(3)))
    assert not _forward(model, cache, spans, tokens, positions, kernel, stack=True)[2]
    # more decodes than the skinny kernel takes rows: the gemm runs, not the stack
    rows = kernel_linear.skinny_rows(torch.float32)
    assert _forward(model, *_case(model, 3, [20] * rows), kernel, stack=True)[2]
    assert not _forward(model, *_case(model, 3, [20] * (rows + 1)), kernel, stack=True)[2]


def test_the_environment_turns_the_stack_off_and_a_bad_value_is_an_error(tiny_models,
                                                                        monkeypatch):
    from engine.kernels import compiled

    monkeypatch.setenv("PDSERVE_DECODE_STACK", "0")
    model = load_model(tiny_models["llama"], dtype="float32")
    assert not _forward(model, *_case(model, 4, [20, 4]), compiled(), stack=True)[2]
    monkeypatch.setenv("PDSERVE_DECODE_STACK", "yes")
    with pytest.raises(ValueError, match="PDSERVE_DECODE_STACK='yes'"):
        load_model(tiny_models["llama"], dtype="float32")
