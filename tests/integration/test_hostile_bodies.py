"""A client attacks a P/D deployment (real proxy with an API key, real P and D engines on
the tiny model, push mode) with request bodies: every attack is a 4xx naming the field, on a
connection the server keeps open, counted; no backend leaves rotation; honest requests beside
the attacks succeed; every KV block comes back.

Issue 26: a lone surrogate was a TypeError → 500 and a reset connection on the engines, and
three of them through the proxy took D out of rotation (every client then got 503); a deeply
nested body was a 500 on the proxy; `prompt: [true, false]` was read as token ids; the
proxy's /health listed the backends to anyone.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
from hostile_corpus import (
    CHAT,
    COMPLETIONS,
    DETOKENIZE,
    SURROGATE,
    TOKENIZE,
    KeepAlive,
    corpus,
    error_of,
    nested,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pd_harness import Deployment, assert_no_leaks, deployment, metric
from test_server_fuzz import any_body, raw_bodies

KEY = "hostile-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
HONEST = {"model": "m", "prompt": "an honest prompt", "max_tokens": 3, "ignore_eos": True}
EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "150"))


@pytest.fixture(scope="module")
def dep(tiny_model: str):
    # A health check every 60 s: a backend the attacks took out would stay out for the test.
    # A short lease: P's blocks for a D leg that D refused come back within seconds.
    with deployment(tiny_model, "push", num_blocks=256, extra={"kv_lease_duration": 3.0},
                    proxy_args=("--api-key", KEY, "--health-interval", "60")) as d:
        yield d


def _honest_request_succeeds(dep: Deployment) -> None:
    r = httpx.post(dep.proxy.url + "/v1/completions", json=HONEST, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def _proxy_metric(dep: Deployment, name: str) -> float:
    text = httpx.get(dep.proxy.url + "/metrics", headers=AUTH, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def _all_in_rotation(dep: Deployment) -> None:
    health = httpx.get(dep.proxy.url + "/health", headers=AUTH, timeout=10)
    assert health.status_code == 200, health.text
    backends = health.json()["prefill"] + health.json()["decode"]
    assert all(b["healthy"] for b in backends), backends
    assert _proxy_metric(dep, "pdserve:proxy_backend_healthy") == 2
    assert _proxy_metric(dep, "pdserve:proxy_backend_failures_total") == 0


# ---- finding 3: invalid Unicode -------------------------------------------------------------

SURROGATE_ATTACKS = [
    (COMPLETIONS, {"prompt": SURROGATE, "max_tokens": 2}, "prompt"),
    (COMPLETIONS, {"prompt": SURROGATE, "max_tokens": 2, "stream": True}, "prompt"),
    (COMPLETIONS, {"prompt": ["fine", "x\udfff"], "max_tokens": 2}, "prompt.1"),
    (COMPLETIONS, {"prompt": "hi", "stop": [SURROGATE]}, "stop.0"),
    (CHAT, {"messages": [{"role": "user", "content": SURROGATE}]}, "messages.0.content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}],
            "stream": True}, "messages.0.content.0.text"),
    (TOKENIZE, {"prompt": SURROGATE}, "prompt"),
    (TOKENIZE, {"messages": [{"role": "user", "content": SURROGATE}]}, "messages.0.content"),
]


def test_lone_surrogates_are_400_naming_the_field_and_eject_no_backend(dep: Deployment) -> None:
    sent = {}
    for target in (dep.p, dep.d):
        conn = KeepAlive(target.url)
        for path, body, field in SURROGATE_ATTACKS:
            err = error_of(*conn.post(path, json.dumps(body).encode()))
            assert err["param"] == field and "not valid Unicode" in err["message"], err
        # the same text as raw UTF-8 bytes (no JSON encoder writes them; a client can)
        err = error_of(*conn.post(COMPLETIONS, b'{"prompt": "a\xed\xa0\x80b"}'))
        assert err["param"] == "prompt", err
        conn.close()
        sent[target.url] = metric(target, "pdserve:http_request_errors_total")
        assert sent[target.url] >= len(SURROGATE_ATTACKS) + 1
    proxy = KeepAlive(dep.proxy.url, AUTH)
    attacks = [a for a in SURROGATE_ATTACKS if a[0] != TOKENIZE]
    for _ in range(3):  # three in a row once took a backend out
        for path, body, field in attacks:
            err = error_of(*proxy.post(path, json.dumps(body).encode()))
            assert err["param"] == field, err
        _honest_request_succeeds(dep)
    # raw UTF-8 surrogate bytes: the proxy's strict parser refuses them, json decodes them,
    # and the body check names the field (not "malformed JSON")
    err = error_of(*proxy.post(COMPLETIONS, b'{"prompt": "a\xed\xa0\x80b"}'))
    assert err["param"] == "prompt" and "not valid Unicode" in err["message"], err
    proxy.close()
    _all_in_rotation(dep)
    assert _proxy_metric(dep, "pdserve:proxy_requests_total") >= 3 * len(attacks)
    assert 'status="400"' in httpx.get(dep.proxy.url + "/metrics", headers=AUTH).text
    # the proxy refused them itself: no leg reached an engine
    for target in (dep.p, dep.d):
        assert metric(target, "pdserve:http_request_errors_total") == sent[target.url]
    assert_no_leaks(dep.engines)


# ---- finding 7: deep nesting, booleans as numbers, the proxy's /health ---------------------


@pytest.mark.parametrize("depth", [100, 5_000, 200_000])
def test_deeply_nested_bodies_are_400_on_the_proxy_and_the_engines(dep: Deployment,
                                                                   depth: int) -> None:
    deep, deep_text = nested(depth), nested(depth, "x")
    bodies = {
        COMPLETIONS: f'{{"prompt": "x", "kv_transfer_params": {{"a": {deep}}}}}',
        CHAT: f'{{"messages": [{{"role": "user", "content": "x"}}], "extra": {deep}}}',
        TOKENIZE: f'{{"prompt": {deep_text}}}',
        DETOKENIZE: f'{{"tokens": {deep}}}',
    }
    for target, headers in ((dep.proxy, AUTH), (dep.p, {}), (dep.d, {})):
        conn = KeepAlive(target.url, headers)
        for path, body in bodies.items():
            if target is dep.proxy and path in (TOKENIZE, DETOKENIZE):
                continue  # the proxy serves the two generation routes only
            err = error_of(*conn.post(path, body.encode()))
            assert "nested" in err["message"] or err["param"], err
        conn.close()
    _honest_request_succeeds(dep)
    _all_in_rotation(dep)


BOOLEANS_AS_NUMBERS = [
    (COMPLETIONS, {"prompt": [True, False]}, "prompt"),
    (COMPLETIONS, {"prompt": [[True]]}, "prompt"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": True}, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "n": True}, "n"),
    (COMPLETIONS, {"prompt": "x", "stop_token_ids": [True]}, "stop_token_ids.0"),
    (COMPLETIONS, {"prompt": "x", "temperature": False}, "temperature"),
    (COMPLETIONS, {"prompt": "x", "data_parallel_rank": False}, "data_parallel_rank"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": True},
     "max_completion_tokens"),
    (DETOKENIZE, {"tokens": [True, 5]}, "tokens.0"),
]


def test_booleans_are_never_numbers(dep: Deployment) -> None:
    for target, headers in ((dep.proxy, AUTH), (dep.p, {}), (dep.d, {})):
        conn = KeepAlive(target.url, headers)
        for path, body, field in BOOLEANS_AS_NUMBERS:
            if target is dep.proxy and path == DETOKENIZE:
                continue
            err = error_of(*conn.post(path, json.dumps(body).encode()))
            assert err["param"] == field, (target.url, body, err)
        conn.close()
    _honest_request_succeeds(dep)
    _all_in_rotation(dep)


def test_proxy_health_names_no_backend_without_the_key(dep: Deployment) -> None:
    anonymous = httpx.get(dep.proxy.url + "/health", timeout=10)
    assert anonymous.status_code == 200 and anonymous.json() == {"status": "ok"}
    for engine in dep.engines:
        assert engine.url.rsplit(":", 1)[1] not in anonymous.text
    wrong = httpx.get(dep.proxy.url + "/health", headers={"Authorization": "Bearer no"})
    assert wrong.json() == {"status": "ok"}
    full = httpx.get(dep.proxy.url + "/health", headers=AUTH, timeout=10).json()
    assert [b["url"] for b in full["prefill"] + full["decode"]] == [dep.p.url, dep.d.url]
    assert full["mode"] == "push"


# ---- the hostile-body fuzz: proxy, P and D, every route ------------------------------------


def test_corpus_is_4xx_everywhere_on_open_connections(dep: Deployment) -> None:
    cases = corpus()
    for target, headers in ((dep.p, {}), (dep.d, {}), (dep.proxy, AUTH)):
        conn = KeepAlive(target.url, headers)
        for case in cases:
            if target is dep.proxy and case.path in (TOKENIZE, DETOKENIZE):
                continue
            status, data = conn.post(case.path, case.body)
            if target is dep.proxy and case.field == "kv_transfer_params" and status == 200:
                continue  # the proxy writes both legs' kv_transfer_params itself
            assert 400 <= status < 500, (target.url, case, status, data[:300])
            err = error_of(status, data)
            if case.field:
                assert (err["param"] or "").split(".")[0] == case.field, (target.url, case, err)
        conn.close()
    _honest_request_succeeds(dep)
    _all_in_rotation(dep)
    assert_no_leaks(dep.engines)


def _for_this_cluster(case: tuple[str, object]) -> tuple[str, object]:
    """test_server_fuzz's bodies, for pd_harness's engines: its served name "tiny" is "m"
    here, and a body that leaves max_tokens open gets 8 (this max_model_len is 1024)."""
    path, body = case
    if isinstance(body, dict):
        body = {**body, "model": "m"} if body.get("model") == "tiny" else dict(body)
        if body.get("max_tokens") is None:
            body["max_tokens"] = 8
    return path, body


_surrogate_text = st.text(max_size=6).map(lambda s: s + SURROGATE)
fuzzed = st.one_of(
    any_body.map(_for_this_cluster),
    st.tuples(st.sampled_from([COMPLETIONS, CHAT]),
              st.fixed_dictionaries({"prompt": _surrogate_text,
                                     "messages": st.just([{"role": "user", "content": "x"}])},
                                    optional={"stop": _surrogate_text})),
)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large])
@given(case=fuzzed, raw=raw_bodies)
def test_fuzzed_bodies_never_get_a_5xx_anywhere(dep: Deployment, case, raw) -> None:
    path, body = case
    for target, headers in ((dep.proxy, AUTH), (dep.p, {}), (dep.d, {})):
        if target is dep.proxy and path in (TOKENIZE, DETOKENIZE):
            continue
        conn = KeepAlive(target.url, headers)
        for sent_path, content in ((path, json.dumps(body).encode()), raw):
            status, data = conn.post(sent_path, content)
            assert status < 500, (target.url, sent_path, content[:200], data[:300])
            if status >= 400:
                error_of(status, data)
        conn.close()


def test_after_the_fuzz_every_backend_serves_and_every_block_is_back(dep: Deployment) -> None:
    _honest_request_succeeds(dep)
    _all_in_rotation(dep)
    assert_no_leaks(dep.engines, timeout=30)
