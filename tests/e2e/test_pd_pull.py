"""1P1D pull through the proxy: same tokens as colocated, KV really moved (D READ it from
P's leased blocks), nothing leaks, and params that do not fit are never read from."""

from __future__ import annotations

import asyncio
import base64
import random
import socket
import time

import httpx
import numpy as np
import openai
import psutil
import pytest
from pd_harness import assert_no_leaks, deployment, engine_stats, metric

from engine import LLM, SamplingParams

MAX_TOKENS = 12
LEASE_S = 4.0  # short, so the expiry test is quick; D's heartbeats keep real leases alive
REMOTE_TOKENS = "pdserve:kv_remote_prefill_tokens_total"
BYTES = "pdserve:kv_transfer_bytes_total"


def _prompts(n: int, seed: int, lo: int = 40, hi: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 2000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_model: str):
    llm = LLM(tiny_model, num_kv_blocks=1024, max_model_len=1024, multiprocess=False)

    def run(prompts: list[list[int]]) -> list[str]:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].text for o in outs]

    yield run
    llm.shutdown()


@pytest.fixture(scope="module")
def pd(tiny_model: str):
    with deployment(tiny_model, "pull", extra={"kv_lease_duration": LEASE_S}) as dep:
        yield dep


async def _complete_all(base_url: str, prompts: list[list[int]]) -> list[str]:
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0,
                                timeout=120)

    async def one(p: list[int]) -> str:
        r = await client.completions.create(model="m", prompt=p, max_tokens=MAX_TOKENS,
                                            temperature=0.0)
        return r.choices[0].text
    try:
        return await asyncio.gather(*(one(p) for p in prompts))
    finally:
        await client.close()


def _stat(server, name: str) -> float:
    return engine_stats(server)["kv_connector"].get(name, 0)


def _p_leg(pd, prompt: list[int]) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {"do_remote_decode": True}}
    r = httpx.post(f"{pd.p.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def _d_leg(pd, prompt: list[int], kv: dict) -> str:
    body = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "kv_transfer_params": kv}
    r = httpx.post(f"{pd.d.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_pull_through_proxy_matches_colocated_and_moves_the_kv(pd, reference):
    prompts = _prompts(32, seed=7)
    before = metric(pd.d, REMOTE_TOKENS)
    returned = _stat(pd.p, "kv_pull_leases_returned_total")
    expired = metric(pd.p, "pdserve:kv_lease_expired_total")
    texts = asyncio.run(_complete_all(pd.proxy.url, prompts))
    assert texts == reference(prompts)
    # Fresh random prompts: D had no prefix hits and READ all but the last prompt token.
    assert metric(pd.d, REMOTE_TOKENS) - before == sum(len(p) - 1 for p in prompts)
    assert_no_leaks(pd.engines)
    assert _stat(pd.p, "kv_pull_leases_returned_total") - returned == len(prompts)
    assert metric(pd.p, "pdserve:kv_lease_expired_total") == expired  # freed on D's word


def test_kv_read_on_d_equals_what_p_computed(pd):
    prompt = _prompts(1, seed=11, lo=100, hi=100)[0]
    asyncio.run(_complete_all(pd.proxy.url, [prompt]))
    body = {"prompt_token_ids": prompt}
    p_blocks = httpx.post(f"{pd.p.url}/debug/prompt_kv", json=body, timeout=10).json()["blocks"]
    d_blocks = httpx.post(f"{pd.d.url}/debug/prompt_kv", json=body, timeout=10).json()["blocks"]
    assert len(p_blocks) == len(d_blocks) == 100 // 16
    for pb, db in zip(p_blocks, d_blocks, strict=True):
        a = np.frombuffer(base64.b64decode(pb), dtype=np.float32)
        b = np.frombuffer(base64.b64decode(db), dtype=np.float32)
        assert np.abs(a).sum() > 0
        np.testing.assert_array_equal(a, b)  # READ copies bytes: bit-identical
    assert_no_leaks(pd.engines)


def test_partial_prefix_hit_on_d_reads_only_the_missing_blocks(pd, reference):
    base = _prompts(1, seed=41, lo=64, hi=64)[0]
    longer = base + _prompts(1, seed=42, lo=50, hi=50)[0]
    bytes_before = metric(pd.d, BYTES)
    asyncio.run(_complete_all(pd.proxy.url, [base]))  # D reads 4 blocks and caches them
    four_blocks = metric(pd.d, BYTES) - bytes_before
    before, bytes_before = metric(pd.d, REMOTE_TOKENS), metric(pd.d, BYTES)
    texts = asyncio.run(_complete_all(pd.proxy.url, [longer]))
    assert texts == reference([longer])
    # 114 tokens = blocks 0-7: D holds 0-3 (64 tokens) and reads exactly 4-7 from P.
    assert metric(pd.d, REMOTE_TOKENS) - before == len(longer) - 1 - 64
    assert metric(pd.d, BYTES) - bytes_before == four_blocks > 0
    assert_no_leaks(pd.engines)


def test_params_for_another_prompt_or_replayed_are_never_read(pd, reference):
    a, b = _prompts(2, seed=51, lo=80, hi=80)  # same length: only the digest tells them apart
    refused = _stat(pd.d, "kv_pull_refused_params_total")
    reads = _stat(pd.d, "kv_pull_reads_total")
    kv_a = _p_leg(pd, a)
    assert _d_leg(pd, b, kv_a) == reference([b])[0]  # wrong prompt: D prefills itself
    assert _d_leg(pd, a, kv_a) == reference([a])[0]  # the right one reads
    assert _d_leg(pd, a, kv_a) == reference([a])[0]  # a replay: P's blocks are gone
    assert _stat(pd.d, "kv_pull_refused_params_total") - refused == 2
    assert _stat(pd.d, "kv_pull_reads_total") - reads == 1
    assert_no_leaks(pd.engines)


def test_unclaimed_lease_expires_and_late_params_are_refused(pd, reference):
    prompt = _prompts(1, seed=61, lo=90, hi=90)[0]
    expired = metric(pd.p, "pdserve:kv_lease_expired_total")
    kv = _p_leg(pd, prompt)  # no D leg follows
    assert_no_leaks(pd.engines, timeout=LEASE_S + 5)
    assert metric(pd.p, "pdserve:kv_lease_expired_total") == expired + 1
    refused = _stat(pd.d, "kv_pull_refused_params_total")
    assert _d_leg(pd, prompt, kv) == reference([prompt])[0]
    assert _stat(pd.d, "kv_pull_refused_params_total") == refused + 1


def test_unreachable_p_falls_back_to_local_prefill(pd, reference):
    prompt = _prompts(1, seed=71, lo=70, hi=70)[0]
    kv = _p_leg(pd, prompt)
    failed = metric(pd.d, "pdserve:kv_recv_failed_total")
    fallback = metric(pd.d, "pdserve:kv_recompute_fallback_total")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]  # nothing listens here
    assert _d_leg(pd, prompt, {**kv, "remote_port": dead_port}) == reference([prompt])[0]
    assert metric(pd.d, "pdserve:kv_recv_failed_total") == failed + 1
    assert metric(pd.d, "pdserve:kv_recompute_fallback_total") == fallback + 1
    assert_no_leaks(pd.engines, timeout=LEASE_S + 5)  # P's lease expires: nobody read it


def test_chat_stream_and_fan_out_through_proxy(pd, reference):
    """Chat and streams read like completions; a prompt list with n=2 pairs every prompt
    with its own KV or none (P answers for the first prompt only: the others prefill on D,
    and their unclaimed leases on P expire)."""
    messages = [{"role": "user", "content": "tell me about the blocks of a KV cache"}]
    body = {"model": "m", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    local = httpx.post(f"{pd.p.url}/v1/chat/completions", json=body, timeout=60).json()
    before = metric(pd.d, REMOTE_TOKENS)
    via = httpx.post(f"{pd.proxy.url}/v1/chat/completions", json=body, timeout=60).json()
    assert via["choices"][0]["message"] == local["choices"][0]["message"]
    assert metric(pd.d, REMOTE_TOKENS) - before == via["usage"]["prompt_tokens"] - 1
    client = openai.OpenAI(base_url=f"{pd.proxy.url}/v1", api_key="x", max_retries=0,
                           timeout=120)
    prompt = _prompts(1, seed=82)[0]
    before = metric(pd.d, REMOTE_TOKENS)
    stream = client.completions.create(model="m", prompt=prompt, max_tokens=MAX_TOKENS,
                                       temperature=0.0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == reference([prompt])[0]
    assert metric(pd.d, REMOTE_TOKENS) - before == len(prompt) - 1
    prompts = _prompts(2, seed=81, lo=48, hi=48)  # same length: a mix-up would not be caught
    r = client.completions.create(model="m", prompt=prompts, n=2, max_tokens=MAX_TOKENS,
                                  temperature=0.0)
    expected = reference(prompts)
    by_index = sorted(r.choices, key=lambda c: c.index)
    assert [c.text for c in by_index] == [expected[0], expected[0], expected[1], expected[1]]
    assert_no_leaks(pd.engines, timeout=LEASE_S + 5)


@pytest.mark.parametrize(("params", "field"), [
    ({"do_remote_prefill": True, "remote_engine_id": "P0", "remote_host": "127.0.0.1",
      "remote_port": 1, "tp_size": 1, "num_prompt_tokens": 1, "remote_request_id": "r"},
     "remote_block_ids"),
    ({"do_remote_prefill": True, "remote_engine_id": "P0", "remote_host": "127.0.0.1",
      "remote_port": 1, "tp_size": 1, "num_prompt_tokens": 1, "remote_request_id": "r",
      "remote_block_ids": [-1]}, "remote_block_ids"),
    ({"do_remote_prefill": True, "remote_engine_id": "P0", "remote_host": "127.0.0.1",
      "remote_port": 1, "tp_size": 1, "num_prompt_tokens": "1", "remote_request_id": "r",
      "remote_block_ids": [0]}, "num_prompt_tokens"),
    ({"do_remote_prefill": True, "remote_engine_id": "P0", "remote_host": "127.0.0.1",
      "remote_port": 1, "tp_size": 1, "num_prompt_tokens": 1, "remote_block_ids": [0]},
     "remote_request_id"),
    ({"do_remote_prefill": "yes"}, "do_remote_prefill"),
    # a prefill of another TP size (pull reads from TP 1 only; docs/design.md §8)
    ({"do_remote_prefill": True, "remote_engine_id": "P0", "remote_host": "127.0.0.1",
      "remote_port": 1, "tp_size": 2, "num_prompt_tokens": 1, "remote_request_id": "r",
      "remote_block_ids": [0]}, "kv_transfer_params.tp_size"),
])
def test_bad_kv_transfer_params_is_a_400_naming_the_field(pd, params, field):
    body = {"model": "m", "prompt": "hello", "max_tokens": 2, "kv_transfer_params": params}
    r = httpx.post(f"{pd.d.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]
    ok = httpx.post(f"{pd.d.url}/v1/completions",
                    json={"model": "m", "prompt": "hello", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200
    assert httpx.get(f"{pd.d.url}/health", timeout=5).status_code == 200


def test_idle_engines_use_almost_no_cpu(pd):
    time.sleep(1.0)  # let the last request's thread work settle
    procs = [p for s in pd.engines
             for p in [psutil.Process(s.pid), *(c for c in s.descendants() if c.is_running())]]
    before = [p.cpu_times() for p in procs]
    time.sleep(5.0)
    for p, b in zip(procs, before, strict=True):
        a = p.cpu_times()
        used = (a.user + a.system) - (b.user + b.system)
        assert used / 5.0 < 0.02, f"pid {p.pid} {p.cmdline()[:3]} used {used / 5.0:.1%}"
