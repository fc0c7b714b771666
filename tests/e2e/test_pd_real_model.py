"""1P1D push on the real SmolLM2-135M-Instruct GGUF: what the tiny model cannot prove.

30 layers, GQA 9/3 (head_dim 64), tied embeddings and a real chat template: push moves every
layer's KV for 3 KV heads, D decodes from it and answers exactly as the colocated engine does,
in float32 and in bfloat16 (bf16 KV on the wire). One deployment per dtype, loaded once.

In bfloat16 a matmul's rounding depends on how many rows it multiplies, and every decode step
on D runs beside other requests than colocated's does (D also starts from P's sampled token).
So bf16 answers are equal, or part at a near-tie: at the first differing token both candidates
are within BF16_TIE_MARGIN of each other in the colocated engine's own logprobs. How many of
the answers part is the batch's luck, not a property: each parting is judged, none is counted.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from pd_harness import assert_no_leaks, deployment, metric

from engine import LLM, SamplingParams
from engine.models.source import resolve_model
from engine.protocol import StructuredOutput

MAX_TOKENS = 32
# Four bf16 steps at |logit| 16..32 (0.125 each). Two were observed in most runs, three once
# (a CI run of session 18: 0.375), as the batches around a token vary with timing; a wrong
# layer's or block's KV parts at once and by nats, far outside it.
BF16_TIE_MARGIN = 0.5
REMOTE_TOKENS = "pdserve:kv_remote_prefill_tokens_total"
QUESTIONS = [
    "What is the capital of France?", "Why is the sky blue?", "Write a haiku about the sea.",
    "Give me a tip for learning to code.", "Who wrote Romeo and Juliet?",
    "What does a CPU do?",
]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return resolve_model("smollm2")


@pytest.fixture(scope="module")
def colocated(gguf_path: str, dtype: str):
    llm = LLM(gguf_path, dtype=dtype, num_kv_blocks=256, max_model_len=1024, multiprocess=False)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def pd(gguf_path: str, dtype: str):
    with deployment(gguf_path, "push", num_blocks=256, engine_args=("--dtype", dtype)) as dep:
        yield dep


def _chat_ids(llm: LLM) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
            for q in QUESTIONS]


async def _complete_all(base_url: str, prompts: list[list[int]]) -> list[tuple[str, list[str]]]:
    """Each prompt's (text, token strings) through the proxy."""
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0,
                                timeout=300)

    async def one(p: list[int]) -> tuple[str, list[str]]:
        r = await client.completions.create(model="m", prompt=p, max_tokens=MAX_TOKENS,
                                            temperature=0.0, logprobs=1)
        return r.choices[0].text, list(r.choices[0].logprobs.tokens)

    try:
        return await asyncio.gather(*(one(p) for p in prompts))
    finally:
        await client.close()


def _assert_equal_or_near_tie(got: list[tuple[str, list[str]]], want, tokenizer) -> None:
    """bf16: every answer equals colocated's, or first differs where colocated's logprobs of
    the two tokens are within BF16_TIE_MARGIN."""
    identical, parts = 0, []
    for i, ((text, tokens), out) in enumerate(zip(got, want, strict=True)):
        comp = out.outputs[0]
        if text == comp.text:
            identical += 1
            continue
        mine = [tokenizer.decode([t], skip_special_tokens=False) for t in comp.token_ids]
        k = next(j for j, (a, b) in enumerate(zip(tokens, mine, strict=False)) if a != b)
        top = {tokenizer.decode([t], skip_special_tokens=False): lp
               for t, lp in comp.logprobs[k].items()}
        assert tokens[k] in top, f"prompt {i} token {k}: {tokens[k]!r} not in top-5 {top}"
        gap = top[mine[k]] - top[tokens[k]]
        parts.append((i, k, round(gap, 3)))
        assert 0 <= gap <= BF16_TIE_MARGIN, f"prompt {i} token {k}: gap {gap}"
    print(f"bf16 P/D vs colocated: {identical}/{len(got)} identical; (prompt, token, gap) "
          f"{parts}")


def test_push_on_real_gqa_model_equals_colocated_and_moves_every_layer(pd, colocated, dtype):
    prompts = _chat_ids(colocated)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5)
    want = colocated.generate([{"prompt_token_ids": p} for p in prompts], params,
                              use_tqdm=False)
    remote_before = metric(pd.d, REMOTE_TOKENS)
    bytes_before = metric(pd.p, "pdserve:kv_transfer_bytes_total")
    writes_before = metric(pd.p, "pdserve:kv_push_writes_total")
    got = asyncio.run(_complete_all(pd.proxy.url, prompts))
    if dtype == "float32":
        assert [text for text, _ in got] == [o.outputs[0].text for o in want]
        assert got[0][0] == "The capital of France is Paris."
    else:
        _assert_equal_or_near_tie(got, want, colocated.get_tokenizer())
    # D received every prompt token but the last, less what its own prefix cache held (at
    # most the two 16-token blocks of the shared system prompt per request).
    remote = metric(pd.d, REMOTE_TOKENS) - remote_before
    full = sum(len(p) - 1 for p in prompts)
    assert full - 32 * len(prompts) <= remote <= full
    assert metric(pd.p, "pdserve:kv_push_writes_total") - writes_before >= len(prompts)
    # A token's KV: 30 layers x K,V x 3 heads x 64 dims x (4 or 2 bytes); whole 16-token blocks.
    per_token = 30 * 2 * 3 * 64 * (4 if dtype == "float32" else 2)
    moved = metric(pd.p, "pdserve:kv_transfer_bytes_total") - bytes_before
    assert moved >= remote * per_token and moved % (16 * per_token) == 0
    assert_no_leaks(pd.engines)


def test_chat_with_the_models_template_through_the_proxy(pd, colocated, dtype):
    client = openai.OpenAI(base_url=f"{pd.proxy.url}/v1", api_key="x", max_retries=0,
                           timeout=300)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=MAX_TOKENS,
                                       temperature=0.0)
    tok = colocated.get_tokenizer()
    prompt = tok.encode(tok.apply_chat_template(messages))
    (want,) = colocated.generate([{"prompt_token_ids": prompt}],
                                 SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                                 use_tqdm=False)
    assert r.usage.prompt_tokens == len(prompt)
    assert r.choices[0].finish_reason == "stop"  # the model ends its turn with <|im_end|>
    assert "Paris" in r.choices[0].message.content
    if dtype == "float32":
        assert r.choices[0].message.content == want.outputs[0].text
    assert_no_leaks(pd.engines)


def test_json_object_chat_parses_and_equals_colocated(pd, colocated, dtype):
    """Issue 31: response_format json_object on the real model, through P/D (P samples the
    first token under the grammar, D continues it): the answer parses as a JSON object."""
    client = openai.OpenAI(base_url=f"{pd.proxy.url}/v1", api_key="x", max_retries=0,
                           timeout=300)
    messages = [{"role": "user", "content": "Describe a cat as JSON with a name and an age."}]
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=60,
                                       temperature=0.0, response_format={"type": "json_object"})
    answer = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(answer), dict), answer
    if dtype == "float32":
        tok = colocated.get_tokenizer()
        prompt = tok.encode(tok.apply_chat_template(messages))
        (want,) = colocated.generate(
            [{"prompt_token_ids": prompt}],
            SamplingParams(temperature=0.0, max_tokens=60,
                           structured=StructuredOutput("json_object")), use_tqdm=False)
        assert answer == want.outputs[0].text
