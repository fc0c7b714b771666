"""`pdserve serve` end to end: a real server subprocess (python -m engine.server) with the tiny
model, driven by the official `openai` client and raw HTTP.

One server serves most tests (module fixture); the engine-death and SIGTERM tests each get a
server of their own, started in the background while the shared one is being used.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import time

import httpx
import openai
import psutil
import pytest
from pd_harness import engine_core, wait_until
from server_streams import Stream, assert_died_fast

from pdserve.launcher import ServerProcess, launch_server

API_KEY = "test-key"
MODEL = "tiny"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 512
BODY_LIMIT = 65536
DRAIN_TIMEOUT = 6.0
COMMON = ["--served-model-name", MODEL, "--num-kv-blocks", "512",
          "--max-model-len", str(MAX_MODEL_LEN)]


def _start(tiny_model: str, log_dir: str, name: str, *args: str) -> ServerProcess:
    return launch_server(tiny_model, *COMMON, *args, wait=False,
                         log_path=os.path.join(log_dir, f"{name}.log"))


@pytest.fixture(scope="module")
def servers(tiny_model: str, tmp_path_factory: pytest.TempPathFactory):
    """The shared server plus the two that the lifecycle tests kill; all start together."""
    log_dir = str(tmp_path_factory.mktemp("server-logs"))
    started = {
        "main": _start(tiny_model, log_dir, "main", "--api-key", API_KEY,
                       "--max-request-body-bytes", str(BODY_LIMIT)),
        "death": _start(tiny_model, log_dir, "death"),
        # The drain test holds this server's engine (SIGSTOP) for most of the drain: a
        # heartbeat deadline well past it, so the held core is not taken for a hung one.
        "drain": _start(tiny_model, log_dir, "drain", "--drain-timeout", str(DRAIN_TIMEOUT),
                        "--max-model-len", "4096",
                        "--heartbeat-timeout", str(10 * DRAIN_TIMEOUT)),
    }
    try:
        for s in started.values():
            s.wait_healthy(300)
        yield started
    finally:
        for s in started.values():
            s.stop()


@pytest.fixture(scope="module")
def server(servers) -> ServerProcess:
    return servers["main"]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def offline_llm(tiny_model: str):
    from engine import LLM

    llm = LLM(model=tiny_model)
    yield llm
    llm.shutdown()


def _greedy(max_tokens: int, **kw):
    from engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def _sse_events(lines) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


# ---- generation ------------------------------------------------------------------------


def test_greedy_completion_equals_offline_llm(client, offline_llm):
    prompts = ["Hello world", "the cat sat on the"]
    ref = offline_llm.generate(prompts, _greedy(12), use_tqdm=False)
    for prompt, expected in zip(prompts, ref, strict=True):
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                         temperature=0)
        choice = resp.choices[0]
        assert choice.text == expected.outputs[0].text
        assert choice.finish_reason == expected.outputs[0].finish_reason
        assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)
        assert resp.usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_batched_prompts_get_indexed_choices(client, offline_llm):
    prompts = ["Hello world", "the cat sat on the"]
    ref = offline_llm.generate(prompts, _greedy(6), use_tqdm=False)
    resp = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == [r.outputs[0].text for r in ref]


def test_stream_equals_nonstream_and_ends_with_done(server, client):
    kw = dict(model=MODEL, prompt="streaming is", max_tokens=10, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    body = {"model": MODEL, "prompt": "raw", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH,
                      timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    assert all(json.loads(e)["object"] == "text_completion" for e in events[:-1])


def test_chat_matches_offline_and_stream_agrees(server, client, offline_llm):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "name a colour"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                          temperature=0)
    # The server's own rendering of the conversation, generated offline, gives the same text.
    tok = httpx.post(server.url + "/tokenize", json={"messages": messages}, headers=AUTH,
                     timeout=30).json()
    ref = offline_llm.generate({"prompt_token_ids": tok["tokens"]}, _greedy(8), use_tqdm=False)
    assert full.choices[0].message.content == ref[0].outputs[0].text
    assert full.choices[0].message.role == "assistant"
    assert full.usage.prompt_tokens == tok["count"]
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_n2_and_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL, prompt="once upon a time", max_tokens=8, temperature=1.0, n=2,
              seed=1234, extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 16
    other = [client.completions.create(**{**kw, "seed": s}).choices[0].text for s in (1, 2, 3)]
    assert any(t != a.choices[0].text for t in other)  # the seed really steers sampling
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [texts[0], texts[1]] == [c.text for c in sorted(a.choices, key=lambda c: c.index)]


def test_stop_string_cuts_the_text(client):
    base = client.completions.create(model=MODEL, prompt="the cat sat", max_tokens=16,
                                     temperature=0, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    start = next(i for i in range(3, len(text) - 3)
                 if text[i:i + 3].isascii() and text[i:i + 3].strip() == text[i:i + 3])
    stop = text[start:start + 3]
    cut = client.completions.create(model=MODEL, prompt="the cat sat", max_tokens=16,
                                    temperature=0, stop=[stop, "never-seen-xyz"],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_completion_and_chat_logprobs(client):
    resp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0,
                                     logprobs=3, extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert sampled <= 0 and 1 <= len(top) <= 4
        assert sampled == pytest.approx(max(top.values()), abs=1e-4)  # greedy = the best
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert "".join(t.token for t in content) == chat.choices[0].message.content or any(
        "\ufffd" in t.token for t in content)


def test_64_concurrent_streams_all_complete(server):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int, str | None, str]:
        want = 4 + i % 5
        stream = await client.completions.create(
            model=MODEL, prompt=f"request number {i}", max_tokens=want, temperature=0.8,
            seed=i, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        text, finish, usage = "", None, None
        async for chunk in stream:
            for c in chunk.choices:
                text += c.text
                finish = c.finish_reason or finish
            usage = chunk.usage or usage
        return want, usage.completion_tokens, finish, text

    async def run() -> list:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY,
                                      max_retries=0, timeout=240) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(run())
    assert len(results) == 64
    for want, got, finish, text in results:
        assert got == want and finish == "length" and text


# ---- bad input ---------------------------------------------------------------------------


def _post(server, path: str, *, body=None, content=None, headers=None) -> httpx.Response:
    hdrs = {**AUTH, **(headers or {})}
    if content is not None:
        hdrs.setdefault("Content-Type", "application/json")
        return httpx.post(server.url + path, content=content, headers=hdrs, timeout=30)
    return httpx.post(server.url + path, json=body, headers=hdrs, timeout=30)


@pytest.mark.parametrize(("case", "kwargs", "status", "param"), [
    ("malformed json", {"content": b'{"prompt": "x",'}, 400, None),
    ("not an object", {"body": [1, 2, 3]}, 400, None),
    ("wrong prompt type", {"body": {"prompt": 5}}, 400, "prompt"),
    ("wrong max_tokens type", {"body": {"prompt": "x", "max_tokens": "many"}}, 400, "max_tokens"),
    ("negative max_tokens", {"body": {"prompt": "x", "max_tokens": -1}}, 400, "max_tokens"),
    ("negative temperature", {"body": {"prompt": "x", "temperature": -1}}, 400, "temperature"),
    ("empty prompt", {"body": {"prompt": ""}}, 400, "prompt"),
    ("prompt too long", {"body": {"prompt": [5] * (MAX_MODEL_LEN + 10)}}, 400, "prompt"),
    ("huge max_tokens", {"body": {"prompt": "x", "max_tokens": 100000}}, 400, "max_tokens"),
    ("token out of vocab", {"body": {"prompt": [10**9]}}, 400, "prompt_token_ids"),
    ("empty stop string", {"body": {"prompt": "x", "stop": [""]}}, 400, "stop"),
    ("unknown model", {"body": {"prompt": "x", "model": "gpt-9"}}, 404, "model"),
])
def test_bad_completion_input_is_a_4xx_openai_error(server, case, kwargs, status, param):
    r = _post(server, "/v1/completions", **kwargs)
    assert r.status_code == status, (case, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, (case, err)


def test_bad_chat_input_and_auth_and_size(server):
    assert _post(server, "/v1/chat/completions", body={"messages": []}).status_code == 400
    r = _post(server, "/v1/chat/completions", body={"messages": [{"role": "robot"}]})
    assert r.status_code == 400 and "messages" in r.json()["error"]["param"]
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, headers=headers,
                       timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200  # no key needed
    big = json.dumps({"prompt": "x" * (BODY_LIMIT + 10)}).encode()
    assert _post(server, "/v1/completions", content=big).status_code == 413

    def chunked():
        yield b'{"prompt": "'
        for _ in range(BODY_LIMIT // 1000 + 2):
            yield b"x" * 1000
        yield b'"}'

    r = httpx.post(server.url + "/v1/completions", content=chunked(), timeout=30,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.get(server.url + "/v1/nowhere", headers=AUTH, timeout=30)
    assert r.status_code == 404 and "error" in r.json()


GUARDED = [("GET", "/v1/models", None, 200),
           ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}, 200),
           ("POST", "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}, 200),
           ("GET", "/metrics", None, 200), ("GET", "/engine_stats", None, 200),
           ("POST", "/tokenize", {"prompt": "x"}, 200), ("POST", "/detokenize",
                                                          {"tokens": [5]}, 200),
           ("GET", "/version", None, 200),
           ("GET", "/kv_transfer/info", None, 404),  # this server has no kv config
           ("GET", "/v1/nowhere", None, 404)]


@pytest.mark.parametrize(("method", "path", "body", "status"), GUARDED,
                         ids=[f"{m} {p}" for m, p, _, _ in GUARDED])
def test_api_key_guards_every_route_but_health(server, method, path, body, status):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.request(method, server.url + path, json=body, headers=headers, timeout=30)
        assert r.status_code == 401, (path, headers, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.request(method, server.url + path, json=body, headers=AUTH, timeout=30)
    assert r.status_code == status, r.text
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


class _KeyedStub:
    """An engine for the routes around generation (kv info, stats, debug)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.max_model_len = tokenizer, 64

    async def check_health(self):
        return None

    async def get_stats(self):
        return {"num_free_blocks": 4, "num_kv_blocks": 4}

    async def debug_prompt_kv(self, ids):
        return []

    async def kv_transfer_info(self):
        return {}  # nothing bound beyond the configured values


@pytest.mark.parametrize("public_metrics", [False, True])
def test_api_key_guards_kv_info_stats_and_debug_routes(tiny_model, monkeypatch, public_metrics):
    from fastapi.testclient import TestClient

    from engine.models.tokenizer import Tokenizer
    from engine.server.app import ServerSettings, build_app

    monkeypatch.setenv("PDSERVE_DEBUG_ROUTES", "1")
    info = {"engine_id": "p0", "kv_host": "127.0.0.1", "kv_port": 1, "tp_size": 1,
            "block_size": 16, "kv_role": "kv_producer", "kv_connector": "NixlPushConnector"}
    settings = ServerSettings(api_key=API_KEY, kv_transfer_info=info,
                              public_metrics=public_metrics)
    app = build_app(_KeyedStub(Tokenizer.from_dir(tiny_model)), model_name=MODEL,
                    settings=settings)
    routes = [("GET", "/kv_transfer/info", None), ("GET", "/engine_stats", None),
              ("POST", "/debug/prompt_kv", {"prompt_token_ids": [1]}), ("GET", "/metrics", None)]
    with TestClient(app) as c:
        for method, path, body in routes:
            open_route = public_metrics and path == "/metrics"
            r = c.request(method, path, json=body)
            assert r.status_code == (200 if open_route else 401), (path, r.text)
            assert c.request(method, path, json=body, headers=AUTH).status_code == 200, path
        assert c.get("/health").status_code == 200


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-5)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    bad = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# ---- auxiliary routes ----------------------------------------------------------------------


def test_models_tokenize_detokenize_version_kv_info(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    tok = _post(server, "/tokenize", body={"prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == MAX_MODEL_LEN
    detok = _post(server, "/detokenize", body={"tokens": tok["tokens"]}).json()
    assert detok["prompt"] == "Hello world"
    assert _post(server, "/detokenize", body={"tokens": [10**8]}).status_code == 400
    assert httpx.get(server.url + "/version", headers=AUTH, timeout=30).json()["version"]
    r = httpx.get(server.url + "/kv_transfer/info", headers=AUTH, timeout=30)
    assert r.status_code == 404 and "error" in r.json()


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_metrics_count_tokens_and_latencies(server, client):
    before = httpx.get(server.url + "/metrics", headers=AUTH, timeout=30).text
    client.completions.create(model=MODEL, prompt="count me", max_tokens=5,
                              extra_body={"ignore_eos": True})
    text = httpx.get(server.url + "/metrics", headers=AUTH, timeout=30).text
    gen = "pdserve:generation_tokens_total"
    assert _metric(text, gen) - _metric(before, gen) == 5
    assert _metric(text, "pdserve:prompt_tokens_total") > _metric(before,
                                                                  "pdserve:prompt_tokens_total")
    for name in ("pdserve:time_to_first_token_seconds_count",
                 "pdserve:e2e_request_latency_seconds_count",
                 "pdserve:inter_token_latency_seconds_count"):
        assert _metric(text, name) > _metric(before, name), name
    for name in ("pdserve:num_requests_running", "pdserve:num_requests_waiting",
                 "pdserve:kv_cache_usage_perc", "pdserve:num_free_kv_blocks"):
        assert f"\n{name}{{" in text, name
    for name in ("pdserve:kv_push_writes_total", "pdserve:kv_transfer_bytes_total",
                 "pdserve:kv_remote_prefill_tokens_total", "pdserve:kv_transfer_seconds_count"):
        assert f"\n{name}{{" not in text, name  # no connector: no transfer series (issue 32)
    assert _metric(text, "pdserve:num_free_kv_blocks") == 512


def _generated(server: ServerProcess) -> float:
    return _metric(httpx.get(server.url + "/metrics", headers=AUTH, timeout=30).text,
                   "pdserve:generation_tokens_total")


def _settled(server: ServerProcess) -> float:
    """The generated-token count once it has stopped moving for half a second."""
    last, deadline = _generated(server), time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = _generated(server)
        if now == last:
            return now
        last = now
    raise AssertionError("generation never stopped")


def _holds_connection(server: ServerProcess, client_port: int) -> bool:
    """Whether the server process still has its end of the client's TCP connection open."""
    return any(c.raddr and c.raddr.port == client_port
               for c in psutil.Process(server.pid).net_connections(kind="tcp"))


def test_client_disconnect_aborts_the_request(server, client):
    """A client that goes away mid-generation, streaming or not, stops its request: the
    engine generates far fewer than max_tokens for it and frees its blocks. No bet on the
    CPU's speed: the test holds the engine (SIGSTOP) from before the client leaves until the
    server has closed its end of the connection (the abort is on its way to the core), so
    the engine cannot decode ahead of the abort; the non-streaming client hangs up once the
    metrics show its request generating."""
    max_tokens = MAX_MODEL_LEN - 16
    body = {"model": MODEL, "prompt": "a very long story", "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}
    engine = server.descendants()
    start = _generated(server)
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH,
                          timeout=60) as r:
            port = r.extensions["network_stream"].get_extra_info("socket").getsockname()[1]
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: ")
                if events >= 2:
                    break
            _signal_all(engine, signal.SIGSTOP)
        wait_until(lambda: not _holds_connection(server, port), 30,
                   "the server to close the stream")
    finally:
        _signal_all(engine, signal.SIGCONT)
    after_stream = _settled(server)
    assert 2 <= after_stream - start < max_tokens / 2
    payload = json.dumps({**body, "stream": False}).encode()
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
                         f"Authorization: {AUTH['Authorization']}\r\n"
                         f"Content-Type: application/json\r\nContent-Length: {len(payload)}"
                         "\r\n\r\n".encode() + payload)
            wait_until(lambda: _generated(server) > after_stream, 60,
                       "the non-streaming request to start")
            _signal_all(engine, signal.SIGSTOP)
            client_port = sock.getsockname()[1]
        wait_until(lambda: not _holds_connection(server, client_port), 30,
                   "the server to drop the non-streaming request")
    finally:
        _signal_all(engine, signal.SIGCONT)
    assert _settled(server) - after_stream < max_tokens / 2
    # The next request's outputs carry a fresh scheduler snapshot: only it may be running.
    client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    text = httpx.get(server.url + "/metrics", headers=AUTH, timeout=30).text
    assert _metric(text, "pdserve:num_requests_running") == 0
    assert _metric(text, "pdserve:num_free_kv_blocks") == 512


# ---- lifecycle ---------------------------------------------------------------------------


def _clients(server: ServerProcess) -> int:
    """The server's open client connections."""
    port = int(server.url.rsplit(":", 1)[1])
    return sum(c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port
               for c in psutil.Process(server.pid).net_connections(kind="tcp"))


def test_engine_death_fails_open_requests_fast(servers):
    server = servers["death"]
    longest = MAX_MODEL_LEN - 16
    streams = [Stream(server.url, longest) for _ in range(3)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.first.wait(120) and s.status == 200 and s.events
    # Held (SIGSTOP) until it is killed: the streams cannot finish first however fast the
    # CPU decodes, and the non-streaming request waits at the server for the engine.
    core = engine_core(server.pid)
    core.send_signal(signal.SIGSTOP)
    waiting = Stream(server.url, longest, stream=False)  # a non-streaming one in flight too
    waiting.start()
    wait_until(lambda: _clients(server) == 4, 30, "the server to take the non-streaming request")
    core.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    waiting.join(10)
    assert waiting.ended_at is not None and waiting.ended_at - killed < 2.0
    assert waiting.status == 503 and json.loads(waiting.events[0])["error"]["code"] == "engine_dead"
    assert_died_fast(streams, killed, server)  # the API server answers, it does not hang or crash


def _signal_all(procs: list[psutil.Process], sig: int) -> None:
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(sig)


# a connection refused while the server closes: no listener any more, or a reset (the kernel
# queued the connection; the listener closed before taking it)
_CLOSED = (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)


def _draining(server: ServerProcess) -> bool:
    """True once the server refuses new requests: 503 `draining`, or no listener any more."""
    try:
        r = httpx.get(server.url + "/health", timeout=1)
    except _CLOSED:
        return True
    except httpx.TimeoutException:
        return False
    return r.status_code == 503 and r.json()["error"]["code"] == "draining"


def test_sigterm_drains_in_flight_requests_then_exits(servers):
    """In-flight requests that can finish do; one that cannot is aborted shortly before the
    deadline (finish_reason "abort", then [DONE]); new requests are refused; exit 0.

    No bet on the CPU's speed: the test holds the server's engine processes (SIGSTOP) from
    before SIGTERM, so the short requests are still in flight when it comes; it lets the
    engine go (SIGCONT) only until they are done and holds it again, so the long one is
    still running at the deadline however fast this CPU decodes; it lets it go once more
    after the abort, so the engine can shut down."""
    server = servers["drain"]
    descendants = server.descendants()
    assert descendants
    short = [Stream(server.url, 8) for _ in range(3)]
    endless = Stream(server.url, 4000)  # held: aborted at the deadline
    for s in [*short, endless]:
        s.start()
    for s in [*short, endless]:
        assert s.first.wait(120) and s.status == 200 and s.events
    _signal_all(descendants, signal.SIGSTOP)
    try:
        server.process.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        wait_until(lambda: _draining(server), DRAIN_TIMEOUT / 2, "the server to drain")
        try:  # a new request is refused: a 503 while the server closes, or no connection
            r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, timeout=5)
            assert r.status_code == 503 and r.json()["error"]["code"] == "draining", r.text
        except _CLOSED:
            pass
        _signal_all(descendants, signal.SIGCONT)  # the short requests finish in the drain
        for s in short:
            s.join(DRAIN_TIMEOUT)
            assert s.error is None and s.events[-1] == "[DONE]"
            assert s.usage_tokens() == 8
        _signal_all(descendants, signal.SIGSTOP)
        assert endless.ended_at is None, "the test did not hold the long request"
        endless.join(DRAIN_TIMEOUT + 5)
    finally:
        _signal_all(descendants, signal.SIGCONT)
    assert endless.error is None and endless.events[-1] == "[DONE]"
    assert endless.ended_at - sent < DRAIN_TIMEOUT
    finishes = [c["finish_reason"] for e in endless.events[:-1]
                for c in json.loads(e)["choices"] if c["finish_reason"]]
    assert finishes == ["abort"]
    server.process.wait(DRAIN_TIMEOUT + 10)
    assert time.monotonic() - sent < DRAIN_TIMEOUT + 10  # drain, then the engine's shutdown
    assert server.process.returncode == 0
    _, alive = psutil.wait_procs(descendants, timeout=5)
    assert not alive


# ---- in-process pieces: CLI → config, /kv_transfer/info, connector metrics -------------------


def test_cli_flags_and_role_defaults_build_the_engine_config(tiny_model):
    import argparse

    from engine.server.cli import add_serve_args, config_from_args, kv_transfer_info

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    parser.add_argument("--kv-host", default="127.0.0.1")
    parser.add_argument("--kv-port", type=int, default=0)
    args = parser.parse_args([
        tiny_model, "--block-size", "32", "--max-num-seqs", "7", "--seed", "3",
        "--kv-transfer-config", '{"kv_connector": "NixlPushConnector", "engine_id": "p0", '
        '"kv_port": 5601, "kv_connector_extra_config": {"kv_lease_duration": 9}}',
        "--kv-host", "10.0.0.2"])
    role = {"kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_producer",
                                   "kv_connector_extra_config": {"backends": ["UCX"]}},
            "max_num_seqs": 99, "max_num_batched_tokens": 512}
    config = config_from_args(args, role)
    assert (config.block_size, config.max_num_seqs, config.seed) == (32, 7, 3)
    assert config.max_num_batched_tokens == 512  # role default where no flag was given
    kv = config.kv_transfer_config
    assert (kv.kv_connector, kv.kv_role, kv.engine_id) == ("NixlPushConnector", "kv_producer", "p0")
    assert (kv.kv_host, kv.kv_port) == ("10.0.0.2", 5601)  # the JSON's port wins over the flag
    assert kv.kv_connector_extra_config == {"backends": ["UCX"], "kv_lease_duration": 9}
    assert kv_transfer_info(config) == {
        "engine_id": "p0", "kv_host": "10.0.0.2", "kv_port": 5601, "tp_size": 1,
        "kv_ports": [5601], "block_size": 32,
        "kv_role": "kv_producer", "kv_connector": "NixlPushConnector"}
    plain = config_from_args(parser.parse_args([tiny_model]))
    assert plain.kv_transfer_config is None and kv_transfer_info(plain) is None


class _StubEngine:
    """Just enough engine for routes that never generate."""

    def __init__(self, tokenizer, live_info=None):
        self.tokenizer, self.max_model_len, self._live = tokenizer, 64, live_info

    async def check_health(self):
        return None

    def kv_transfer_info(self):
        return self._live


def test_kv_transfer_info_route_reports_config_and_live_values(tiny_model):
    from fastapi.testclient import TestClient

    from engine.models.tokenizer import Tokenizer
    from engine.server.app import ServerSettings, build_app

    info = {"engine_id": "p0", "kv_host": "127.0.0.1", "kv_port": 0, "tp_size": 1,
            "block_size": 16, "kv_role": "kv_producer", "kv_connector": "NixlPushConnector"}
    engine = _StubEngine(Tokenizer.from_dir(tiny_model), live_info={"kv_port": 5555})
    app = build_app(engine, model_name=MODEL, settings=ServerSettings(kv_transfer_info=info))
    with TestClient(app) as c:
        assert c.get("/kv_transfer/info").json() == {**info, "kv_port": 5555}


def test_connector_counters_are_exported_from_cumulative_values():
    from engine.protocol import SchedulerStats
    from engine.server.metrics import ServerMetrics

    m = ServerMetrics(MODEL)
    for writes in (3, 5):  # cumulative: the exported counter is set, not summed
        m.record(scheduler_stats=SchedulerStats(
            num_running_reqs=2, num_free_blocks=40, kv_cache_usage=0.25,
            kv_connector={"kv_push_writes_total": writes, "pdserve:kv_transfer_bytes_total": 4096,
                          "kv_transfer_seconds_sum": 0.5, "kv_transfer_seconds_count": 2,
                          "garbage": "x"}),
            iteration_stats=None)
    text = m.render().decode()
    assert _metric(text, "pdserve:kv_push_writes_total") == 5
    assert _metric(text, "pdserve:kv_transfer_bytes_total") == 4096
    assert _metric(text, "pdserve:kv_transfer_seconds_sum") == 0.5
    assert _metric(text, "pdserve:kv_transfer_seconds_count") == 2
    assert _metric(text, "pdserve:num_requests_running") == 2
    assert _metric(text, "pdserve:kv_cache_usage_perc") == 0.25
    assert _metric(text, "pdserve:kv_recv_failed_total") == 0
    assert ServerMetrics(MODEL).registry is not m.registry  # two apps, no clash
