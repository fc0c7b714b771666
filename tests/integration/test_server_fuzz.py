"""Bounded fuzzing of the HTTP API of a real `pdserve serve` process: whatever the body, the
answer is never a 5xx, every error has the OpenAI error shape, every stream is well formed,
and the server is healthy (and has nothing left running) afterwards.

The server runs with a small --max-model-len so even requests that ask for "as many tokens as
fit" stay short; the example count is bounded so the module takes well under a minute on an
idle machine.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.launcher import ServerProcess, launch_server

MODEL = "tiny"
MAX_MODEL_LEN = 48
EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "120"))


@pytest.fixture(scope="module")
def server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    log = str(tmp_path_factory.mktemp("fuzz") / "server.log")
    with launch_server(tiny_model, "--served-model-name", MODEL, "--num-kv-blocks", "256",
                       "--max-model-len", str(MAX_MODEL_LEN),
                       "--max-request-body-bytes", "16384", log_path=log) as s:
        yield s


@pytest.fixture(scope="module")
def http(server: ServerProcess):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


# ---- strategies ------------------------------------------------------------------------------

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=10,
)
def _mostly(valid: st.SearchStrategy, invalid: st.SearchStrategy) -> st.SearchStrategy:
    """About 90% valid values, so many bodies get past validation into the engine."""
    return st.sampled_from(range(10)).flatmap(lambda i: invalid if i == 7 else valid)


bad_ints = st.one_of(st.integers(-3, 0), st.sampled_from([10**6, -(2**31), 2**63, 2**80]),
                     json_scalars)
bad_floats = st.one_of(st.floats(-5, -0.01), st.floats(2.01, 50),
                       st.sampled_from([float("nan"), float("inf"), -float("inf")]),
                       json_scalars)
prob = _mostly(st.floats(0.05, 1.0), bad_floats)
penalty = _mostly(st.floats(-2.0, 2.0), bad_floats)
prompt = _mostly(
    st.one_of(st.text(min_size=1, max_size=40),
              st.lists(st.integers(0, 2047), min_size=1, max_size=12),
              st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=2)),
    st.one_of(st.just(""), st.lists(st.integers(-5, 5000), max_size=12),
              st.lists(st.lists(st.integers(0, 2047), max_size=5), max_size=2), json_values),
)


def _optional(**fields: st.SearchStrategy) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({}, optional=fields)


sampling_fields = dict(
    model=_mostly(st.just(MODEL), st.one_of(st.text(max_size=5), json_values)),
    n=_mostly(st.integers(1, 2), st.one_of(st.sampled_from([0, -1, 10**9, "2"]), json_values)),
    temperature=_mostly(st.floats(0.0, 2.0), bad_floats),
    top_p=prob, min_p=_mostly(st.floats(0.0, 0.2), bad_floats),
    top_k=_mostly(st.integers(-1, 50), bad_ints),
    seed=_mostly(st.integers(0, 2**32), st.integers(-(2**70), 2**70)),
    stop=_mostly(st.one_of(st.text(min_size=1, max_size=3),
                           st.lists(st.text(min_size=1, max_size=3), max_size=3)),
                 st.one_of(st.just(""), st.lists(st.just(""), min_size=1), json_values)),
    stop_token_ids=_mostly(st.lists(st.integers(0, 2047), max_size=3),
                           st.one_of(st.lists(st.integers(-2, 10**10), min_size=1), json_values)),
    presence_penalty=penalty, frequency_penalty=penalty,
    repetition_penalty=_mostly(st.floats(0.5, 2.0), bad_floats),
    min_tokens=_mostly(st.integers(0, 2), bad_ints),
    ignore_eos=_mostly(st.booleans(), json_scalars),
    logit_bias=_mostly(st.none() | st.just({}),
                       st.dictionaries(st.text(max_size=3), st.floats(-1, 1), max_size=2)),
    kv_transfer_params=_mostly(st.none(), st.dictionaries(st.text(max_size=5), json_scalars,
                                                          max_size=2)),
    user=_mostly(st.text(max_size=5), json_values),
)
max_tokens = _mostly(st.integers(1, 8), bad_ints)
usage_option = st.fixed_dictionaries({"include_usage": st.booleans()})
streaming = _mostly(
    st.one_of(st.just({}), st.just({"stream": False}), st.just({"stream": True}),
              st.fixed_dictionaries({"stream": st.just(True), "stream_options": usage_option})),
    st.fixed_dictionaries({"stream": st.one_of(st.booleans(), json_scalars),
                           "stream_options": json_values}),
)
chat_logprobs = _mostly(
    st.one_of(st.just({}), st.just({"logprobs": False}),
              st.fixed_dictionaries({"logprobs": st.just(True)},
                                    optional={"top_logprobs": st.integers(0, 5)})),
    st.fixed_dictionaries({"logprobs": json_scalars, "top_logprobs": bad_ints}),
)


def _merge(*parts: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    return st.tuples(*parts).map(lambda ds: {k: v for d in ds for k, v in d.items()})


completion_bodies = _merge(
    streaming,
    st.fixed_dictionaries({"prompt": prompt, "max_tokens": max_tokens}),
    _optional(**sampling_fields, logprobs=_mostly(st.integers(0, 5), bad_ints),
              echo=st.booleans(), suffix=_mostly(st.none(), st.text(max_size=3))),
)
message = _mostly(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                           "content": st.one_of(st.text(max_size=30), st.lists(
                               st.fixed_dictionaries({"type": st.just("text"),
                                                      "text": st.text(max_size=10)}),
                               max_size=2))}),
    st.one_of(st.fixed_dictionaries({"role": st.sampled_from(["robot", "user"]),
                                     "content": json_values}), json_values),
)
chat_bodies = _merge(
    streaming, chat_logprobs,
    st.fixed_dictionaries({"messages": _mostly(st.lists(message, min_size=1, max_size=3),
                                               json_values),
                           "max_tokens": max_tokens}),
    _optional(**sampling_fields, max_completion_tokens=_mostly(st.integers(1, 8), bad_ints),
              add_generation_prompt=st.booleans(), continue_final_message=st.booleans()),
)
any_body = st.one_of(
    completion_bodies.map(lambda b: ("/v1/completions", b)),
    chat_bodies.map(lambda b: ("/v1/chat/completions", b)),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize",
                               "/detokenize"]), json_values),
    st.fixed_dictionaries({"tokens": st.lists(st.integers(-3, 5000), max_size=6)}).map(
        lambda b: ("/detokenize", b)),
    st.fixed_dictionaries({"prompt": st.text(max_size=20)}).map(lambda b: ("/tokenize", b)),
)
raw_bodies = st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
                       st.binary(max_size=64))


# ---- checks ----------------------------------------------------------------------------------


def _check_response(r: httpx.Response, events: list[str] | None) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(
            err["message"], str)
        return
    if events is not None:
        assert events and events[-1] == "[DONE]", events[-3:]
        for e in events[:-1]:
            payload = json.loads(e)
            assert "error" not in payload, payload  # no mid-stream failure for any input
            assert payload["object"] in ("text_completion", "chat.completion.chunk")


def _send(http: httpx.Client, path: str, body: object) -> None:
    content = json.dumps(body).encode()  # NaN / Infinity are emitted on purpose
    headers = {"Content-Type": "application/json"}
    streaming = isinstance(body, dict) and body.get("stream") is True
    if streaming:
        with http.stream("POST", path, content=content, headers=headers) as r:
            events = None
            if r.status_code == 200:
                events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
            else:
                r.read()
            _check_response(r, events)
    else:
        _check_response(http.post(path, content=content, headers=headers), None)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large])
@given(case=any_body)
def test_fuzzed_json_bodies_never_get_a_5xx(http, case):
    path, body = case
    _send(http, path, body)


@settings(max_examples=max(10, EXAMPLES // 4), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=raw_bodies)
def test_fuzzed_raw_bytes_never_get_a_5xx(http, case):
    path, raw = case
    r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    _check_response(r, None)


def test_server_is_healthy_and_idle_after_fuzzing(http):
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "still fine",
                                           "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    metrics = http.get("/metrics").text
    running = [ln for ln in metrics.splitlines() if ln.startswith("pdserve:num_requests_running")]
    assert running and float(running[0].rsplit(" ", 1)[1]) == 0
