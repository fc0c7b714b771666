"""A client with HTTP access to D sends D legs alone, naming the real P and transfers no P
request carries (made-up transfer ids, request ids, or a pull-mode leg): they must not pin D's
blocks nor hang. P answers such a registration PUSH_FAIL after `push_unknown_transfer_timeout`
(`kv_push_unknown_transfer_total`); D counts a failed receipt, computes the prompt itself and
frees every block, and an honest request beside the attack gets its answer. A leg shaped for
pull mode is a 400 naming the field at admission.

Against the old code the attacker's registrations were held for `push_registration_timeout`
(here 60 s): the honest request starved behind them and the attacker's legs hung.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from fault_kit import (
    MAX_TOKENS,
    both_legs,
    cluster,
    kv_stat,
    legs,
    post,
    prompts,
    table,
    text_of,
    wait_for,
)
from pd_harness import assert_no_leaks, engine_stats

pytestmark = pytest.mark.timeout(240)

D_BLOCKS = 64  # D: 1024 tokens; P has plenty
UNKNOWN_S = 2.0  # push_unknown_transfer_timeout
TTL = 60.0  # push_registration_timeout: what a stray registration held D's blocks for before
ATTACK_TOKENS = 300  # 19 blocks each: three legs hold 57 of D's 64 blocks
HONEST_TOKENS = 300
UNKNOWN = "kv_push_unknown_transfer_total"


@pytest.fixture(scope="module")
def dep(tiny_model: str):
    with cluster(tiny_model, num_blocks=D_BLOCKS, name="strays",
                 p_args=("--num-kv-blocks", "512"),
                 extra={"push_registration_timeout": TTL,
                        "push_unknown_transfer_timeout": UNKNOWN_S}) as d:
        yield d


def _counts(dep) -> dict[str, float]:
    return {"unknown": kv_stat(dep.p, UNKNOWN),
            "fail_sent": kv_stat(dep.p, "kv_push_fail_sent_total"),
            "recv_failed": kv_stat(dep.d, "kv_recv_failed_total"),
            "recomputed": kv_stat(dep.d, "kv_recompute_fallback_total"),
            "expired": kv_stat(dep.d, "kv_registration_expired_total")}


def _grew(before: dict[str, float], dep) -> dict[str, float]:
    return {k: v - before[k] for k, v in _counts(dep).items()}


def _stray_leg(dep, prompt: list[int], tid: str | None) -> dict:
    """A D leg naming the real P, for a transfer no P leg will ever bring."""
    _, d_leg = legs(dep, prompt, tid)
    return d_leg


@pytest.mark.parametrize("by", ["transfer_id", "request_id"])
def test_stray_d_legs_do_not_pin_ds_blocks_and_an_honest_request_gets_through(
        dep, reference, by):
    """Three D legs sent straight to D with made-up transfer ids (or, without a transfer
    id, request ids no P request has) hold 57 of D's 64 blocks; an honest 300-token request
    through the proxy needs 19. P refuses the strays within the unknown-transfer timeout:
    each is counted, D recomputes them (their answers are right too), and the honest request
    is answered long before the registration ttl."""
    attack = prompts(3, seed=811 if by == "transfer_id" else 812, lo=ATTACK_TOKENS,
                     hi=ATTACK_TOKENS)
    honest = prompts(1, seed=813 if by == "transfer_id" else 819, lo=HONEST_TOKENS,
                     hi=HONEST_TOKENS)[0]
    before = _counts(dep)

    async def run() -> tuple[list[httpx.Response], httpx.Response, float]:
        strays = [asyncio.create_task(post(
            dep.d.url, _stray_leg(dep, p, f"made-up-{by}-{i}" if by == "transfer_id" else None),
            f"stray-{by}-{i}", timeout=TTL)) for i, p in enumerate(attack)]
        await asyncio.to_thread(wait_for, lambda: table(dep.d, "d_waiting") == 3, 20,
                                "the three strays to hold D's blocks")
        free = engine_stats(dep.d)["num_free_blocks"]
        assert free < -(-HONEST_TOKENS // 16), free  # the honest request does not fit now
        started = time.monotonic()
        body = {"model": "m", "prompt": honest, "max_tokens": MAX_TOKENS, "temperature": 0.0}
        out = await post(dep.proxy.url, body, f"honest-{by}", timeout=TTL)
        waited = time.monotonic() - started
        return list(await asyncio.gather(*strays)), out, waited

    stray_outs, out, waited = asyncio.run(run())
    assert text_of(out) == reference([honest])[0]
    assert waited < TTL / 4, f"the honest request waited {waited:.1f}s behind the strays"
    # D computed each stray's prompt itself: a client gets an answer, never a hang
    assert [text_of(o) for o in stray_outs] == reference(attack)
    grew = _grew(before, dep)
    assert grew["unknown"] == 3 and grew["fail_sent"] == 3, grew  # P refused and counted each
    assert grew["recv_failed"] == 3 and grew["recomputed"] == 3, grew  # D counted each
    assert grew["expired"] == 0, grew  # P's word ended the wait, not D's watchdog
    assert_no_leaks(dep.engines)


def test_an_honest_d_leg_before_its_p_leg_is_not_a_stray(dep, reference):
    """The proxy sends both legs at once; whichever arrives first, the registration is
    carried by P's request and its KV is written (no PUSH_FAIL)."""
    prompt = prompts(1, seed=815, lo=60, hi=60)[0]
    before = _counts(dep)
    writes = kv_stat(dep.p, "kv_push_writes_total")
    out, _ = both_legs(dep, dep.d, prompt, "tid-honest-pair")
    assert text_of(out) == reference([prompt])[0]
    assert kv_stat(dep.p, "kv_push_writes_total") == writes + 1
    assert _grew(before, dep) == {"unknown": 0, "fail_sent": 0, "recv_failed": 0,
                                  "recomputed": 0, "expired": 0}
    assert_no_leaks(dep.engines)


def test_a_push_fail_is_a_failed_receipt_on_d(dep, reference):
    """P's PUSH_FAIL for a registration of another prompt (same transfer id) ends D's wait:
    D counts one failed receipt and one recompute (`kv_recv_failed_total`), and answers."""
    p_prompt, d_prompt = prompts(2, seed=816, lo=60, hi=60)
    p_leg, _ = legs(dep, p_prompt, "tid-other-prompt")
    _, d_leg = legs(dep, d_prompt, "tid-other-prompt")
    before = _counts(dep)

    async def run() -> httpx.Response:
        assert (await post(dep.p.url, p_leg, "other-prompt")).status_code == 200
        return await post(dep.d.url, d_leg, "other-prompt", timeout=TTL)

    started = time.monotonic()
    out = asyncio.run(run())
    assert text_of(out) == reference([d_prompt])[0]
    assert time.monotonic() - started < TTL / 4
    grew = _grew(before, dep)
    assert grew["fail_sent"] == 1 and grew["recv_failed"] == 1 and grew["recomputed"] == 1, grew
    assert_no_leaks(dep.engines)


PULL_FIELDS = {"remote_request_id": "cmpl-victim-0123abcd", "remote_block_ids": [0, 1, 2],
               "num_prompt_tokens": 40, "lease_expires_at": 4102444800.0}


def test_a_pull_shaped_d_leg_at_a_push_d_is_a_400_naming_the_field(dep, reference):
    """P's pull-mode answer forwarded to a push D (a pull proxy, or a client naming P's
    blocks): refused at admission, naming the field, at once; the engine serves on."""
    prompt = prompts(1, seed=817, lo=40, hi=40)[0]
    _, d_leg = legs(dep, prompt, None)
    d_leg["kv_transfer_params"].update(PULL_FIELDS)
    started = time.monotonic()
    r = asyncio.run(post(dep.d.url, d_leg, "pull-shaped", timeout=TTL / 4))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("kv_transfer_params.remote_block_ids")
    assert time.monotonic() - started < 5
    for name in sorted(set(PULL_FIELDS) - {"remote_request_id"}):  # vLLM push legs carry it
        # each pull-only field on its own is named
        _, leg = legs(dep, prompt, "tid-pull-field")
        leg["kv_transfer_params"][name] = PULL_FIELDS[name]
        r = asyncio.run(post(dep.d.url, leg, f"pull-{name}"))
        assert r.status_code == 400 and name in r.json()["error"]["message"], r.text
    out, _ = both_legs(dep, dep.d, prompt, "tid-after-pull-shaped")
    assert text_of(out) == reference([prompt])[0]
    assert_no_leaks(dep.engines)
