"""LLM.generate against Hugging Face transformers' greedy generate, token for token."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from bf16_referee import REFEREE_PATHS, judge, runs_here

from engine import LLM, SamplingParams
from engine.kernels import compiled

MAX_TOKENS = 32
LENGTHS = [1, 2, 3, 5, 8, 15, 16, 17, 31, 33, 64, 100, 127, 160, 211, 256, 300]


def _prompts(vocab: int, special: set[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    allowed = [t for t in range(vocab) if t not in special]
    return [[rng.choice(allowed) for _ in range(n)] for n in LENGTHS]


def _shared_prefix_prompts(vocab: int, special: set[int]) -> list[list[int]]:
    rng = random.Random(1)
    allowed = [t for t in range(vocab) if t not in special]
    prefix = [rng.choice(allowed) for _ in range(70)]
    return [prefix + [rng.choice(allowed) for _ in range(rng.randint(1, 40))] for _ in range(16)]


def hf_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_tokens, do_sample=False)
            outs.append(gen[0, len(p):].tolist())
    return outs


def _ours(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _assert_same(ours: list[list[int]], ref: list[list[int]]) -> None:
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert a == b, f"prompt {i} (len {LENGTHS[i] if i < len(LENGTHS) else '?'}) differs"


def _assert_no_leak(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats["num_free_blocks"] == stats["num_kv_blocks"], stats
    assert stats["num_unfinished_requests"] == 0, stats


@functools.cache
def _hf_refs(model: str, vocab: int, special: frozenset[int]) -> tuple[list, list]:
    """Transformers' answers for the plain and the shared-prefix prompts (made once per model,
    shared by the TP=1 and TP=2 runs)."""
    return (hf_greedy(model, _prompts(vocab, set(special)), MAX_TOKENS),
            hf_greedy(model, _shared_prefix_prompts(vocab, set(special)), MAX_TOKENS))


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_transformers_batched_chunked_and_prefix_cached(
    tiny_models: dict[str, str], arch: str, tp: int
) -> None:
    """At tp=2 the model runs sharded in two worker processes (gloo all-reduce)."""
    model = tiny_models[arch]
    llm = LLM(model, num_kv_blocks=512, multiprocess=False, tensor_parallel_size=tp)
    tok = llm.get_tokenizer()
    prompts = _prompts(tok.vocab_size, set(tok.all_special_ids))
    ref, shared_ref = _hf_refs(model, tok.vocab_size, frozenset(tok.all_special_ids))
    assert any(len(r) == MAX_TOKENS for r in ref)
    _assert_same(_ours(llm, prompts), ref)
    _assert_no_leak(llm)

    shared = _shared_prefix_prompts(tok.vocab_size, set(tok.all_special_ids))
    _assert_same(_ours(llm, shared), shared_ref)  # later prompts hit earlier ones' blocks
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    again = llm.generate([{"prompt_token_ids": p} for p in shared], params, use_tqdm=False)
    assert all(o.num_cached_tokens >= 64 for o in again), [o.num_cached_tokens for o in again]
    _assert_same([list(o.outputs[0].token_ids) for o in again], shared_ref)
    _assert_no_leak(llm)
    llm.shutdown()

    # A small token budget forces chunked prefill mixed with decodes.
    chunked = LLM(model, num_kv_blocks=512, max_num_batched_tokens=48, max_num_seqs=8,
                  multiprocess=False, tensor_parallel_size=tp)
    _assert_same(_ours(chunked, prompts), ref)
    _assert_no_leak(chunked)
    chunked.shutdown()


def test_preemption_gives_the_same_tokens(tiny_model: str) -> None:
    llm = LLM(tiny_model, num_kv_blocks=512, multiprocess=False)
    tok = llm.get_tokenizer()
    prompts = _prompts(tok.vocab_size, set(tok.all_special_ids))[8:16]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plenty = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.shutdown()
    # Enough blocks for the longest request alone, far too few for all at once.
    tight = LLM(tiny_model, num_kv_blocks=24, enable_prefix_caching=False)
    outs = tight.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for a, b in zip(plenty, outs, strict=True):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
    _assert_no_leak(tight)
    tight.shutdown()


def test_seeded_sampling_is_independent_of_the_batch(tiny_model: str) -> None:
    llm = LLM(tiny_model, num_kv_blocks=256, multiprocess=False)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16,
                            ignore_eos=True)
    noise = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    alone = llm.generate(["The seeded one"], seeded, use_tqdm=False)[0]
    crowd = llm.generate(["x y z", "The seeded one", "another prompt here"],
                         [noise, seeded, noise], use_tqdm=False)[1]
    assert list(alone.outputs[0].token_ids) == list(crowd.outputs[0].token_ids)
    other = llm.generate(["The seeded one"], SamplingParams(
        temperature=1.0, top_p=0.9, seed=99, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    assert list(other.outputs[0].token_ids) != list(alone.outputs[0].token_ids)
    _assert_no_leak(llm)
    llm.shutdown()


@pytest.mark.parametrize(
    ("prompt", "kwargs", "field"),
    [
        ("", {}, "prompt"),
        ("x " * 3000, {}, "max_model_len"),
        ("hello", {"max_tokens": 0}, "max_tokens"),
        ("hello", {"max_tokens": -3}, "max_tokens"),
        ("hello", {"top_p": 0.0}, "top_p"),
        ("hello", {"top_p": 1.5}, "top_p"),
        ("hello", {"n": 0}, "n"),
        ("hello", {"not_a_field": 1}, "not_a_field"),
    ],
)
def test_bad_input_is_a_value_error_naming_the_field(
    shared_llm: LLM, prompt: str, kwargs: dict, field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        shared_llm.generate([prompt], SamplingParams(**kwargs), use_tqdm=False)
    out = shared_llm.generate(["still serving"], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1
    _assert_no_leak(shared_llm)


@pytest.fixture(scope="module")
def shared_llm(tiny_model: str):
    llm = LLM(tiny_model, num_kv_blocks=128, max_model_len=512)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("isa", REFEREE_PATHS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_bfloat16_greedy_matches_transformers_bf16_up_to_near_ties(
    tiny_models: dict[str, str], arch: str, isa: str, request: pytest.FixtureRequest,
    tmp_path
) -> None:
    """bf16 weights, bf16 KV, fp32 accumulation (our skinny kernel for decode rows, oneDNN
    for prefill) against transformers in bf16, on each ISA path this CPU has (a lower path in
    a child process: tests/bf16_referee.py). Each of our tokens must be transformers' argmax
    given the prompt and our tokens before it, or tie with it within bf16 rounding
    (BF16_TIE_ULPS); ties go either way by summation order, so the answers themselves may
    part (on an AVX2-only EPYC at token 0 or 1 on exact ties)."""
    if not runs_here(isa, request, tmp_path):
        return
    from transformers import AutoModelForCausalLM

    model = tiny_models[arch]
    llm = LLM(model, dtype="bfloat16", num_kv_blocks=512, multiprocess=False)
    tok = llm.get_tokenizer()
    prompts = _prompts(tok.vocab_size, set(tok.all_special_ids))[::2]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ours = [list(o.outputs[0].token_ids) for o in outs]
    _assert_no_leak(llm)
    llm.shutdown()
    assert sum(map(len, ours)) >= len(ours) * MAX_TOKENS // 2  # real answers, not early EOS
    ref = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
    print(judge(ref, prompts, ours, f"{arch} on {compiled().get_isa()}"))
