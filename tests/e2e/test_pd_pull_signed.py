"""1P1D pull with a KV secret, real processes: P signs the kv_transfer_params it answers
with, the proxy passes them through unchanged, and D reads only blocks P signed for the
prompt D was given, within P's lease. A client calling D directly with blocks of its
choosing gets a 400 before anything reaches D's engine, and D reads nothing."""

from __future__ import annotations

import asyncio
import random

import httpx
import openai
import pytest
from pd_harness import assert_no_leaks, deployment, engine_stats, metric

from engine import LLM, SamplingParams

SECRET = "e2e-pull-signing-secret-0123456789abcdef"
MAX_TOKENS = 10
LEASE_S = 4.0  # short, so waiting out an unclaimed lease is quick
REMOTE_TOKENS = "pdserve:kv_remote_prefill_tokens_total"
BYTES = "pdserve:kv_transfer_bytes_total"


def _prompts(n: int, seed: int, lo: int = 40, hi: int = 200) -> list[list[int]]:
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
    with deployment(tiny_model, "pull",
                    extra={"kv_lease_duration": LEASE_S, "kv_secret": SECRET}) as dep:
        yield dep


def _via_proxy(pd, prompts: list[list[int]]) -> list[str]:
    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{pd.proxy.url}/v1", api_key="x",
                                    max_retries=0, timeout=120)

        async def one(p: list[int]) -> str:
            r = await client.completions.create(model="m", prompt=p, max_tokens=MAX_TOKENS,
                                                temperature=0.0)
            return r.choices[0].text
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.close()
    return asyncio.run(run())


def _p_leg(pd, prompt: list[int]) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {"do_remote_decode": True}}
    r = httpx.post(f"{pd.p.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def _d_leg(pd, prompt: list[int], kv: dict) -> httpx.Response:
    body = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "kv_transfer_params": kv}
    return httpx.post(f"{pd.d.url}/v1/completions", json=body, timeout=60)


def _reads(pd) -> dict[str, float]:
    """Everything that moves when D reads from P, or when a request reaches D's scheduler."""
    d = engine_stats(pd.d)["kv_connector"]
    return {"reads": d.get("kv_pull_reads_total", 0), "bytes": metric(pd.d, BYTES),
            "remote_tokens": metric(pd.d, REMOTE_TOKENS),
            "refused_in_core": d.get("kv_pull_refused_params_total", 0),
            "leases_returned": engine_stats(pd.p)["kv_connector"].get(
                "kv_pull_leases_returned_total", 0)}


def _assert_refused(r: httpx.Response, field: str) -> None:
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(f"kv_transfer_params.{field} "), r.text


def test_signed_pull_through_proxy_matches_colocated_and_moves_the_kv(pd, reference):
    prompts = _prompts(8, seed=101)
    before = metric(pd.d, REMOTE_TOKENS)
    assert _via_proxy(pd, prompts) == reference(prompts)
    assert metric(pd.d, REMOTE_TOKENS) - before == sum(len(p) - 1 for p in prompts)
    assert_no_leaks(pd.engines)


def test_p_signs_its_answer_and_d_reads_it_unchanged(pd, reference):
    prompt = _prompts(1, seed=111)[0]
    kv = _p_leg(pd, prompt)
    assert len(kv["signature"]) == 64 and kv["prompt_digest"] and kv["lease_expires_at"]
    before = _reads(pd)
    r = _d_leg(pd, prompt, {**kv, "do_remote_prefill": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference([prompt])[0]
    assert _reads(pd)["reads"] == before["reads"] + 1
    assert_no_leaks(pd.engines)


def test_prompt_list_reads_the_first_prompt_and_computes_the_others(pd, reference):
    prompts = _prompts(2, seed=121, lo=48, hi=48)
    before = metric(pd.d, REMOTE_TOKENS)
    client = openai.OpenAI(base_url=f"{pd.proxy.url}/v1", api_key="x", max_retries=0,
                           timeout=120)
    r = client.completions.create(model="m", prompt=prompts, max_tokens=MAX_TOKENS,
                                  temperature=0.0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == reference(prompts)
    assert metric(pd.d, REMOTE_TOKENS) - before == len(prompts[0]) - 1
    assert_no_leaks(pd.engines, timeout=LEASE_S + 5)  # prompt 1's lease on P expires


def test_forged_params_are_a_400_before_the_core_and_nothing_is_read(pd, reference):
    victim, attacker = _prompts(2, seed=131, lo=80, hi=80)  # same length and block count
    kv_victim = _p_leg(pd, victim)
    kv_attacker = _p_leg(pd, attacker)
    info = httpx.get(f"{pd.p.url}/kv_transfer/info", timeout=10).json()
    made_up = {"do_remote_prefill": True, "remote_engine_id": info["engine_id"],
               "remote_host": info["kv_host"], "remote_port": info["kv_port"], "tp_size": 1,
               "remote_request_id": kv_victim["remote_request_id"],
               "remote_block_ids": kv_victim["remote_block_ids"],
               "num_prompt_tokens": len(attacker)}
    before = _reads(pd)
    forgeries = [
        (made_up, "signature"),  # no signature at all
        ({**kv_attacker, "signature": "00" * 32}, "signature"),  # a wrong one
        ({**kv_attacker, "signature": kv_attacker["signature"][::-1]}, "signature"),
        # The attacker's own valid signature, with the victim's blocks put in.
        ({**kv_attacker, "remote_block_ids": kv_victim["remote_block_ids"]}, "signature"),
        ({**kv_attacker, "remote_request_id": kv_victim["remote_request_id"],
          "remote_block_ids": kv_victim["remote_block_ids"]}, "signature"),
        ({**kv_attacker, "lease_expires_at": kv_attacker["lease_expires_at"] + 3600},
         "signature"),
        (kv_victim, "prompt_digest"),  # the victim's valid params, for the attacker's prompt
    ]
    for kv, field in forgeries:
        _assert_refused(_d_leg(pd, attacker, {**kv, "do_remote_prefill": True}), field)
    assert _reads(pd) == before  # nothing read, nothing reached D's scheduler
    assert_no_leaks(pd.engines, timeout=LEASE_S + 5)  # the unclaimed leases on P expire
    # The victim's request still answers correctly through the normal flow.
    assert _via_proxy(pd, [victim]) == reference([victim])
    after = _reads(pd)
    assert after["reads"] == before["reads"] + 1
    assert after["remote_tokens"] - before["remote_tokens"] == len(victim) - 1
    assert_no_leaks(pd.engines)


def test_signed_params_past_p_lease_are_a_400(pd, reference):
    prompt = _prompts(1, seed=141)[0]
    kv = _p_leg(pd, prompt)
    assert_no_leaks(pd.engines, timeout=LEASE_S + 5)  # P's lease ran out unclaimed
    before = _reads(pd)
    _assert_refused(_d_leg(pd, prompt, {**kv, "do_remote_prefill": True}), "lease_expires_at")
    assert _reads(pd) == before
    assert _via_proxy(pd, [prompt]) == reference([prompt])
    assert_no_leaks(pd.engines)
