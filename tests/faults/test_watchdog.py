"""D's registration watchdog, P's PUSH_FAIL and handshake failures, under both load-failure
policies. Every case ends with the right tokens (recompute) or an error naming the cause."""

from __future__ import annotations

import asyncio
import time

import pytest
from fault_kit import (
    both_legs,
    cluster,
    free_port,
    kv_stat,
    legs,
    metric,
    post,
    prompts,
    text_of,
)
from pd_harness import assert_no_leaks

TTL = 5.0
DROP_REG = {"fault_injection": {"drop_notif": ["PUSH_REG"]}}


@pytest.fixture(scope="module")
def dep(tiny_model: str):
    # D0 loses every registration and recomputes; D1 loses them and fails the request;
    # D2 is healthy and recomputes. P cannot submit a single WRITE.
    with cluster(tiny_model, extra={"kv_lease_duration": 2.0, "push_registration_timeout": TTL},
                 p_extra={"fault_injection": {"fail_write": True}},
                 d_extras=[DROP_REG, {**DROP_REG, "kv_load_failure_policy": "fail"}, {}],
                 with_proxy=False, name="watchdog") as d:
        yield d


def test_lost_registration_fires_the_watchdog_and_recomputes(dep, reference):
    d0 = dep.decodes[0]
    prompt = prompts(1, seed=101, lo=70, hi=70)[0]
    expired = metric(d0, "pdserve:kv_registration_expired_total")
    fallback = metric(d0, "pdserve:kv_recompute_fallback_total")
    out, latency = both_legs(dep, d0, prompt, "tid-lost-reg")
    assert text_of(out) == reference([prompt])[0]
    assert latency >= TTL * 0.9  # the watchdog, not luck, ended the wait
    assert metric(d0, "pdserve:kv_registration_expired_total") == expired + 1
    assert metric(d0, "pdserve:kv_recompute_fallback_total") == fallback + 1
    assert metric(d0, "pdserve:kv_push_registrations_received_total") == 0
    assert_no_leaks([dep.p, d0], timeout=4 * TTL)


def test_lost_registration_with_fail_policy_is_a_clear_error(dep):
    d1 = dep.decodes[1]
    out, latency = both_legs(dep, d1, prompts(1, seed=102)[0], "tid-lost-reg-fail")
    assert out.status_code >= 400, out.text
    message = out.json()["error"]["message"]
    assert "push_registration_timeout" in message and "tid-lost-reg-fail" in message, message
    assert TTL * 0.9 <= latency < TTL + 10
    assert_no_leaks([dep.p, d1], timeout=4 * TTL)


def test_failed_write_submission_recovers_long_before_the_watchdog(dep, reference):
    d2 = dep.decodes[2]
    prompt = prompts(1, seed=103, lo=60, hi=60)[0]
    failures = metric(dep.p, "pdserve:kv_push_write_failures_total")
    fail_sent = kv_stat(dep.p, "kv_push_fail_sent_total")
    out, latency = both_legs(dep, d2, prompt, "tid-write-fails")
    assert text_of(out) == reference([prompt])[0]
    assert latency < TTL / 2, f"took {latency:.1f}s: PUSH_FAIL did not cut the wait short"
    assert metric(dep.p, "pdserve:kv_push_write_failures_total") == failures + 1
    assert kv_stat(dep.p, "kv_push_fail_sent_total") == fail_sent + 1
    assert metric(d2, "pdserve:kv_registration_expired_total") == 0
    assert metric(d2, "pdserve:kv_recompute_fallback_total") >= 1
    assert_no_leaks([dep.p, d2])


@pytest.mark.parametrize("d_index", [2, 1], ids=["recompute", "fail"])
def test_handshake_with_a_wrong_side_channel_port_fails_fast(dep, reference, d_index):
    d = dep.decodes[d_index]
    dead_port = free_port()
    prompt = prompts(1, seed=104 + d_index, lo=50, hi=50)[0]
    _, d_leg = legs(dep, prompt, f"tid-bad-port-{d_index}", remote_port=dead_port)
    started = time.monotonic()
    out = asyncio.run(post(d.url, d_leg, f"bad-port-{d_index}"))
    latency = time.monotonic() - started
    assert latency < TTL / 2, f"took {latency:.1f}s"
    if d_index == 2:
        assert text_of(out) == reference([prompt])[0]
    else:
        assert out.status_code >= 400, out.text
        message = out.json()["error"]["message"]
        assert f"127.0.0.1:{dead_port}" in message and "P0" in message, message
    assert_no_leaks([dep.p, d])
