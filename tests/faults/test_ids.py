"""Ids a client chooses never decide which KV a request decodes from (issue 15).

One P and two D's behind our proxy, real processes. The attacker (or the careless client)
reuses one X-Request-Id across concurrent requests, picks ids that look like notifications,
sends a D leg whose prompt is not the one P prefills, or D-leg fields the KV wire cannot
carry. A proxy of the test's own speaks vLLM's push protocol: no transfer_id, the same
X-Request-Id on both legs.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx
import pytest
from fault_kit import cluster, legs, metric, post, prompts, text_of
from fault_kit import wait_for as wait
from pd_harness import assert_no_leaks

LEASE = 4.0  # P's blocks refused by id (no transfer_id) are kept for their own D until then
WRITES = "pdserve:kv_push_writes_total"
REMOTE = "pdserve:kv_remote_prefill_tokens_total"
MISMATCH = "pdserve:kv_push_digest_mismatch_total"


@pytest.fixture(scope="module")
def dep(tiny_model: str):
    with cluster(tiny_model, extra={"kv_lease_duration": LEASE},
                 d_extras=[{}, {}], name="ids") as d:
        yield d


def _remote(dep) -> float:
    return sum(metric(d, REMOTE) for d in dep.decodes)


def test_clients_reusing_one_request_id_through_the_proxy_get_their_own_answers(
        dep, reference):
    batch = prompts(8, seed=101, lo=30, hi=110)
    writes, remote = metric(dep.p, WRITES), _remote(dep)

    async def run() -> list[httpx.Response]:
        return await asyncio.gather(*(post(dep.proxy.url, {"model": "m", "prompt": p,
                                                           "max_tokens": 8,
                                                           "temperature": 0.0}, "same-id")
                                      for p in batch))

    answers = asyncio.run(run())
    assert [text_of(r) for r in answers] == reference(batch)
    assert {r.headers["x-request-id"] for r in answers} == {"same-id"}  # echoed label
    assert metric(dep.p, WRITES) - writes == len(batch)
    assert _remote(dep) - remote == sum(len(p) - 1 for p in batch)  # every KV moved
    assert_no_leaks(dep.engines)


async def _vllm_style(dep, prompt: list[int], rid: str, d_index: int) -> httpx.Response:
    """vLLM's push proxy: both legs at once, one X-Request-Id, no transfer_id."""
    p_leg, d_leg = legs(dep, prompt, None)
    d_leg["kv_transfer_params"]["remote_request_id"] = rid
    d_url = dep.decodes[d_index].url
    p_resp, d_resp = await asyncio.gather(post(dep.p.url, p_leg, rid), post(d_url, d_leg, rid))
    assert p_resp.status_code == 200, p_resp.text
    return d_resp


def test_a_vllm_style_proxy_without_transfer_ids_drives_push(dep, reference):
    batch = prompts(6, seed=102, lo=30, hi=110)
    writes, remote = metric(dep.p, WRITES), _remote(dep)

    async def run() -> list[httpx.Response]:
        return await asyncio.gather(*(_vllm_style(dep, p, f"vllm-{i}", i % 2)
                                      for i, p in enumerate(batch)))

    answers = asyncio.run(run())
    assert [text_of(r) for r in answers] == reference(batch)
    assert metric(dep.p, WRITES) - writes == len(batch)
    assert _remote(dep) - remote == sum(len(p) - 1 for p in batch)
    assert_no_leaks(dep.engines)


def test_vllm_style_clients_reusing_an_id_still_get_their_own_answers(dep, reference):
    """Without transfer ids, ids do pair the legs: the prompt digest keeps each request on its
    own KV (a request paired with another prompt's blocks is refused and recomputes)."""
    batch = prompts(4, seed=103, lo=30, hi=110)

    async def run() -> list[httpx.Response]:
        return await asyncio.gather(*(_vllm_style(dep, p, "shared", i % 2)
                                      for i, p in enumerate(batch)))

    assert [text_of(r) for r in asyncio.run(run())] == reference(batch)
    assert_no_leaks(dep.engines)


@pytest.mark.parametrize("rid", ["HB:x", "PUSH_REG:", "PUSH_CANCEL_ACK:1", "a,b", "HB"])
def test_request_ids_that_look_like_notifications_are_harmless(dep, reference, rid):
    """The id reaches the engines as a label only; internal ids escape ':' and ','."""
    prompt = prompts(1, seed=104 + len(rid), lo=40, hi=60)[0]
    writes = metric(dep.p, WRITES)
    assert text_of(asyncio.run(_vllm_style(dep, prompt, rid, 0))) == reference([prompt])[0]
    assert text_of(asyncio.run(post(dep.proxy.url, {"model": "m", "prompt": prompt,
                                                    "max_tokens": 8, "temperature": 0.0},
                                    rid))) == reference([prompt])[0]
    assert metric(dep.p, WRITES) - writes == 2  # both written, none lost
    assert_no_leaks(dep.engines)


@pytest.mark.parametrize("tid", ["tid-other-prompt", None], ids=["transfer_id", "no_id"])
def test_a_registration_for_another_prompt_gets_push_fail_and_d_recomputes(
        dep, reference, tid):
    p_prompt, d_prompt = prompts(2, seed=105 if tid else 106, lo=64, hi=64)
    p_leg, _ = legs(dep, p_prompt, tid)
    _, d_leg = legs(dep, d_prompt, tid)
    rid = f"other-prompt-{tid}"
    mismatch, remote = metric(dep.p, MISMATCH), _remote(dep)

    async def run() -> httpx.Response:
        p_resp, d_resp = await asyncio.gather(post(dep.p.url, p_leg, rid),
                                              post(dep.d.url, d_leg, rid))
        assert p_resp.status_code == 200
        return d_resp

    assert text_of(asyncio.run(run())) == reference([d_prompt])[0]
    wait(lambda: metric(dep.p, MISMATCH) == mismatch + 1, 10, "the digest mismatch count")
    assert _remote(dep) == remote  # nothing of P's prompt landed: D computed its own
    assert_no_leaks(dep.engines, timeout=LEASE + 20)


_BAD_D_FIELDS: list[tuple[str, Any]] = [
    ("transfer_id", "t" * 1025), ("transfer_id", "a,b"), ("transfer_id", ""),
    ("transfer_id", 7), ("tp_size", 4097), ("tp_size", 0), ("remote_engine_id", "e" * 1025),
    ("remote_host", "h" * 256), ("remote_host", ""), ("remote_port", 70000),
    ("remote_port", True),
]


@pytest.mark.parametrize(("field", "value"), _BAD_D_FIELDS,
                         ids=[f"{f}={str(v)[:8]}" for f, v in _BAD_D_FIELDS])
def test_each_d_leg_field_the_wire_cannot_carry_is_a_400_naming_it(dep, field, value):
    _, d_leg = legs(dep, prompts(1, seed=107)[0], "tid-bad-field")
    d_leg["kv_transfer_params"][field] = value
    r = asyncio.run(post(dep.d.url, d_leg, f"bad-{field}"))
    assert r.status_code == 400, r.text
    assert f"kv_transfer_params.{field}" in r.json()["error"]["message"]
    assert_no_leaks(dep.engines)


@pytest.mark.parametrize("value", ["t" * 1025, "a,b", ""])
def test_a_p_leg_transfer_id_the_wire_cannot_carry_is_a_400(dep, value):
    p_leg, _ = legs(dep, prompts(1, seed=108)[0], value)
    r = asyncio.run(post(dep.p.url, p_leg, "bad-p-leg"))
    assert r.status_code == 400 and "kv_transfer_params.transfer_id" in r.text
    assert_no_leaks(dep.engines)


def test_random_reused_ids_under_load_leave_nothing_behind(dep, reference):
    """A mix of our proxy and vLLM-style pairs, ids drawn from a tiny pool."""
    rng = random.Random(109)
    batch = prompts(10, seed=109, lo=20, hi=90)

    async def one(i: int, p: list[int]) -> httpx.Response:
        rid = rng.choice(["a", "b", "HB:c"])
        if i % 2:
            return await post(dep.proxy.url, {"model": "m", "prompt": p, "max_tokens": 8,
                                              "temperature": 0.0}, rid)
        return await _vllm_style(dep, p, rid, i % 4 // 2)

    async def run() -> list[httpx.Response]:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))

    assert [text_of(r) for r in asyncio.run(run())] == reference(batch)
    assert_no_leaks(dep.engines, timeout=LEASE + 20)
