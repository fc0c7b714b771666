"""The vLLM drop-in through a P/D deployment (issue 32): the proxy answers the engines'
helper routes (/tokenize, /detokenize, /version, /tokenizer_info) from a decode backend, and
a loglikelihood request (echo + logprobs) gets every prompt token's logprob, equal to
transformers', from the one engine that prefills it (D alone: a decode leg receiving P's KV
computes no prompt rows); engines with a connector export the kv_* series.
"""

from __future__ import annotations

import httpx
import pytest
from pd_harness import deployment, metric

PROMPT = [3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41]


@pytest.fixture(scope="module")
def dep(tiny_model: str):
    with deployment(tiny_model, "push", num_blocks=128, engine_args=("--dtype", "float32")) as d:
        yield d


def test_helper_routes_through_the_proxy(dep):
    proxy, d = dep.proxy.url, dep.d.url
    tok = httpx.post(proxy + "/tokenize", json={"prompt": "hello world"}, timeout=30)
    assert tok.status_code == 200
    assert tok.json() == httpx.post(d + "/tokenize", json={"prompt": "hello world"}).json()
    ids = tok.json()["tokens"]
    detok = httpx.post(proxy + "/detokenize", json={"tokens": ids}, timeout=30)
    assert detok.status_code == 200 and "hello world" in detok.json()["prompt"]
    for path in ("/version", "/tokenizer_info"):
        r = httpx.get(proxy + path, timeout=30)
        assert r.status_code == 200 and r.json() == httpx.get(d + path).json()
    bad = httpx.post(proxy + "/detokenize", json={"tokens": [10**9]}, timeout=30)
    assert bad.status_code == 400 and "tokens" in bad.text  # D's own 400, relayed


def test_echo_logprobs_through_the_proxy_equal_transformers(dep, tiny_model: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        lp = model(torch.tensor([PROMPT])).logits[0].float().log_softmax(-1)
    ref = [lp[i - 1, PROMPT[i]].item() for i in range(1, len(PROMPT))]
    p_prompts = metric(dep.p, "pdserve:prompt_tokens_total")
    r = httpx.post(dep.proxy.url + "/v1/completions", json={
        "model": "m", "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 1},
        timeout=60)
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert got[0] is None
    assert max(abs(a - b) for a, b in zip(got[1:len(PROMPT)], ref, strict=True)) < 1e-4
    assert metric(dep.p, "pdserve:prompt_tokens_total") == p_prompts  # P never saw it
    assert "pdserve:kv_push_writes_total" in httpx.get(dep.p.url + "/metrics").text


def test_prompt_logprobs_refused_on_a_decode_leg_receiving_kv(dep):
    """A D leg whose prompt KV comes from P runs no prefill forward: no prompt rows to give."""
    info = httpx.get(dep.p.url + "/kv_transfer/info", timeout=10).json()
    r = httpx.post(dep.d.url + "/v1/completions", json={
        "model": "m", "prompt": PROMPT, "prompt_logprobs": 1, "max_tokens": 1,
        "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": info["engine_id"],
                               "remote_host": info["kv_host"], "remote_port": info["kv_port"],
                               "tp_size": info["tp_size"]}}, timeout=30)
    assert r.status_code == 400 and "prompt_logprobs" in r.text
