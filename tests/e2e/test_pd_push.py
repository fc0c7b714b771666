"""1P1D push through the proxy: same tokens as colocated, KV really moved, no leaks."""

from __future__ import annotations

import asyncio
import base64
import random
import time

import httpx
import numpy as np
import openai
import psutil
import pytest
from pd_harness import assert_no_leaks, deployment, metric

from engine import LLM, SamplingParams

MAX_TOKENS = 12
REMOTE_TOKENS = "pdserve:kv_remote_prefill_tokens_total"


def _prompts(n: int, seed: int, lo: int = 40, hi: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 2000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_model: str):
    llm = LLM(tiny_model, num_kv_blocks=1024, max_model_len=1024, multiprocess=False)

    def run(prompts: list[list[int]]) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    yield run
    llm.shutdown()


@pytest.fixture(scope="module")
def pd(tiny_model: str):
    with deployment(tiny_model, "push") as dep:
        yield dep


def _tokens_of(text: str, tokenizer) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


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


def _detok(tiny_model: str, ids: list[list[int]]) -> list[str]:
    from engine.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_model)
    return [tok.decode(t) for t in ids]


def test_push_through_proxy_matches_colocated_and_moves_the_kv(pd, reference, tiny_model):
    prompts = _prompts(32, seed=7)
    before = metric(pd.d, REMOTE_TOKENS)
    texts = asyncio.run(_complete_all(pd.proxy.url, prompts))
    assert texts == _detok(tiny_model, reference(prompts))
    # D had no prefix hits (random prompts, fresh cache): it received all but the last
    # prompt token of every request.
    expected = sum(len(p) - 1 for p in prompts)
    assert metric(pd.d, REMOTE_TOKENS) - before == expected
    assert metric(pd.p, "pdserve:kv_push_writes_total") >= len(prompts)
    assert_no_leaks(pd.engines)


def test_kv_landed_on_d_equals_what_p_computed(pd, reference):
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
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert_no_leaks(pd.engines)


def _legs(pd, prompt: list[int], tid: str | None, rid: str, max_tokens: int = MAX_TOKENS):
    info = httpx.get(f"{pd.p.url}/kv_transfer/info", timeout=5).json()
    # Without tid: vLLM's push protocol, no transfer_id on either leg; P pairs by base id.
    with_tid = {"transfer_id": tid} if tid else {}
    p_leg = {"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
             "kv_transfer_params": {"do_remote_decode": True, **with_tid}}
    d_leg = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
             "kv_transfer_params": {
                 "do_remote_prefill": True, **with_tid,
                 "remote_engine_id": info["engine_id"], "remote_host": info["kv_host"],
                 "remote_port": info["kv_port"], "tp_size": info["tp_size"]}}
    headers = {"X-Request-Id": rid}
    return p_leg, d_leg, headers


def _wait_metric(server, name: str, at_least: float, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while metric(server, name) < at_least:
        assert time.monotonic() < deadline, f"{name} never reached {at_least}"
        time.sleep(0.05)


async def _post(url: str, body: dict, headers: dict) -> dict:
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.post(f"{url}/v1/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        return r.json()


def test_registration_before_finished_blocks(pd, reference, tiny_model):
    prompt = _prompts(1, seed=21)[0]
    p_leg, d_leg, headers = _legs(pd, prompt, "tid-reg-first", "reg-first")
    received = metric(pd.p, "pdserve:kv_push_registrations_received_total")

    async def run() -> dict:
        d_task = asyncio.create_task(_post(pd.d.url, d_leg, headers))
        await asyncio.to_thread(_wait_metric, pd.p,
                                "pdserve:kv_push_registrations_received_total", received + 1)
        await _post(pd.p.url, p_leg, headers)  # only now does P prefill
        return await d_task

    out = asyncio.run(run())
    assert out["choices"][0]["text"] == _detok(tiny_model, reference([prompt]))[0]
    assert_no_leaks(pd.engines)


@pytest.mark.parametrize("tid", ["tid-blocks-first", None], ids=["by_transfer_id", "by_base_id"])
def test_finished_blocks_before_registration(pd, reference, tiny_model, tid):
    prompt = _prompts(1, seed=31 if tid else 32)[0]
    rid = f"blocks-first-{tid or 'base'}"
    p_leg, d_leg, headers = _legs(pd, prompt, tid, rid)
    writes = metric(pd.p, "pdserve:kv_push_writes_total")
    before = metric(pd.d, REMOTE_TOKENS)

    async def run() -> dict:
        await _post(pd.p.url, p_leg, headers)  # P finished: blocks staged under lease
        return await _post(pd.d.url, d_leg, headers)

    out = asyncio.run(run())
    assert out["choices"][0]["text"] == _detok(tiny_model, reference([prompt]))[0]
    assert metric(pd.p, "pdserve:kv_push_writes_total") == writes + 1
    assert metric(pd.d, REMOTE_TOKENS) - before == len(prompt) - 1
    assert_no_leaks(pd.engines)


def test_partial_prefix_hit_on_d_receives_only_the_missing_blocks(pd, reference, tiny_model):
    base = _prompts(1, seed=41, lo=64, hi=64)[0]
    longer = base + _prompts(1, seed=42, lo=50, hi=50)[0]
    asyncio.run(_complete_all(pd.proxy.url, [base]))  # D now caches base's 4 full blocks
    before = metric(pd.d, REMOTE_TOKENS)
    texts = asyncio.run(_complete_all(pd.proxy.url, [longer]))
    assert texts == _detok(tiny_model, reference([longer]))
    # 114 tokens: D holds blocks 0-3 (64 tokens) and receives blocks 4-7 from P.
    assert metric(pd.d, REMOTE_TOKENS) - before == len(longer) - 1 - 64
    assert_no_leaks(pd.engines)


@pytest.mark.parametrize(("params", "field"), [
    ({"do_remote_prefill": True, "transfer_id": "t", "remote_host": "127.0.0.1",
      "remote_port": 1, "tp_size": 1}, "remote_engine_id"),
    ({"do_remote_prefill": True, "transfer_id": "t", "remote_engine_id": "P0",
      "remote_host": "127.0.0.1", "remote_port": "5600", "tp_size": 1}, "remote_port"),
    ({"do_remote_prefill": "yes"}, "do_remote_prefill"),
    ("not an object", "kv_transfer_params"),
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


def _core_processes(server) -> list[psutil.Process]:
    return [p for p in server.descendants() if p.is_running()]


def test_idle_engines_use_almost_no_cpu(pd):
    time.sleep(1.0)  # let the last request's writer work settle
    procs = [p for s in pd.engines for p in [psutil.Process(s.pid), *_core_processes(s)]]
    before = [p.cpu_times() for p in procs]
    time.sleep(5.0)
    for p, b in zip(procs, before, strict=True):
        a = p.cpu_times()
        used = (a.user + a.system) - (b.user + b.system)
        assert used / 5.0 < 0.02, f"pid {p.pid} {p.cmdline()[:3]} used {used / 5.0:.1%}"


def test_prompt_list_and_n_share_one_transfer_id_safely(pd, reference, tiny_model):
    """One client request fanning out (two prompts, n=2) pairs every prompt with its own
    KV: per-prompt transfer ids on both legs; children beyond the first prefill on D."""
    prompts = _prompts(2, seed=51, lo=48, hi=48)  # same length: a mix-up would not be caught
    client = openai.OpenAI(base_url=f"{pd.proxy.url}/v1", api_key="x", max_retries=0,
                           timeout=120)
    r = client.completions.create(model="m", prompt=prompts, n=2, max_tokens=MAX_TOKENS,
                                  temperature=0.0)
    expected = _detok(tiny_model, reference(prompts))
    by_prompt = sorted(r.choices, key=lambda c: c.index)
    assert [c.text for c in by_prompt] == [expected[0], expected[0], expected[1], expected[1]]
    assert_no_leaks(pd.engines)
