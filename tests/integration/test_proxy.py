"""The P/D proxy over real HTTP: real uvicorn servers on loopback ports.

The backends are fakes defined here (OpenAI-shaped answers, SSE and not) that record every leg
they receive and whether it completed or was cancelled by the proxy closing the connection.
A request body may steer a fake decode leg through the extra field `fake_hold`:
"before" (hold before answering), "after_first" (stream: hold after the first chunk) or
"after_done" (stream: keep the body open after `data: [DONE]`),
until the test sets the fake's gate. Prefill legs ignore it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pd_harness import wait_until
from server_thread import ServerThread

from proxy.app import build_app
from proxy.backends import BackendPool
from proxy.config import ProxyConfig
from proxy.kv_info import KVInfoError, PrefillCoordinates
from proxy.legs import (
    CHAT,
    decode_leg_body,
    prefill_leg_body,
    pull_decode_params,
    push_prefill_params,
)
from proxy.metrics import ProxyMetrics
from proxy.relay import ends_with_done_event

pytestmark = pytest.mark.timeout(60)

MODEL = "fake-model"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- fake backends --------------------------------------------------------------------------


@dataclass
class Leg:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None
    chunks_sent: int = 0
    outcome: str | None = None  # "completed" | "cancelled" | "error"
    ended: threading.Event = field(default_factory=threading.Event)

    def finish(self, outcome: str) -> None:
        if self.outcome is None:
            self.outcome, self.finished = outcome, time.monotonic()
            self.ended.set()

    def wait(self, timeout: float = 5.0) -> str | None:
        self.ended.wait(timeout)
        return self.outcome


def _err(message: str, status: int) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                   "code": None}}, status_code=status)


class FakeBackend:
    """A stand-in for a pdserve prefill or decode server."""

    def __init__(self, name: str, kv_port: int = 5600) -> None:
        self.name = name
        self.kv_port = kv_port
        self.legs: list[Leg] = []
        self.health_status = 200
        self.info_status = 200
        self.info_hold = False  # /kv_transfer/info answers only once `gate` is set
        self.info_calls = 0
        self.behaviour = "ok"  # ok | error400 | error500 | hang
        self.delay = 0.0  # seconds before answering
        self.token_interval = 0.005
        self.gate = threading.Event()
        self.after: FakeBackend | None = None  # answer only once `after` has sent a chunk
        self.pull_params = {"remote_block_ids": [3, 4, 5], "remote_engine_id": f"engine-{name}",
                            "remote_host": "127.0.0.1", "remote_port": kv_port, "tp_size": 1}
        self.url = ""
        self.dp_size = 1  # > 1: /kv_transfer/info lists data_parallel_ranks
        self.dead_ranks: set[int] = set()  # legs pinned here answer 503, info says not alive

    def info(self) -> dict[str, Any]:
        info = {"engine_id": f"engine-{self.name}", "kv_host": "127.0.0.1",
                "kv_port": self.kv_port, "tp_size": 1, "block_size": 16,
                "kv_role": "kv_both", "kv_connector": "NixlPushConnector"}
        if self.dp_size > 1:
            info["data_parallel_ranks"] = [
                {"rank": r, "engine_id": f"engine-{self.name}_dp{r}", "kv_host": "127.0.0.1",
                 "kv_port": self.kv_port + r, "alive": r not in self.dead_ranks}
                for r in range(self.dp_size)]
        return info

    def generation_legs(self) -> list[Leg]:
        return [leg for leg in self.legs if leg.path.startswith("/v1/")]

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=self.health_status)

        @app.get("/kv_transfer/info")
        async def info() -> Response:
            self.info_calls += 1
            while self.info_hold and not self.gate.is_set():
                await asyncio.sleep(0.01)
            if self.info_status != 200:
                return _err("no kv info", self.info_status)
            return JSONResponse(self.info())

        @app.get("/v1/models")
        async def models() -> JSONResponse:
            return JSONResponse({"object": "list", "data": [
                {"id": MODEL, "object": "model", "created": 0, "owned_by": self.name}]})

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self._generate(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self._generate(request, chat=True)

        return app

    async def _hold(self, request: Request, seconds: float, gated: bool) -> bool:
        """Wait `seconds` (and for the gate if `gated`); False if the client went away."""
        until = time.monotonic() + seconds
        while time.monotonic() < until or (gated and not self.gate.is_set()):
            if await request.is_disconnected():
                return False
            await asyncio.sleep(0.01)
        return True

    async def _wait_for_other(self, request: Request) -> bool:
        """Wait until `after` has a leg (that sent a chunk, if it streams); False if the
        client went away. Orders the legs' events without relying on timing."""
        other = self.after
        assert other is not None
        while True:
            legs = other.generation_legs()
            if legs and (legs[0].chunks_sent or not legs[0].body.get("stream")
                         or legs[0].body.get("fake_hold") == "before"):
                return True
            if await request.is_disconnected():
                return False
            await asyncio.sleep(0.01)

    async def _generate(self, request: Request, chat: bool) -> Response:
        body = await request.json()
        leg = Leg(request.url.path, dict(request.headers), body)
        self.legs.append(leg)
        prefill_leg = bool((body.get("kv_transfer_params") or {}).get("do_remote_decode"))
        hold = None if prefill_leg else body.get("fake_hold")
        delay = float("inf") if self.behaviour == "hang" else self.delay
        if self.after is not None and not await self._wait_for_other(request):
            leg.finish("cancelled")
            return Response(status_code=499)
        if not await self._hold(request, delay, gated=hold == "before"):
            leg.finish("cancelled")
            return Response(status_code=499)
        if body.get("data_parallel_rank") in self.dead_ranks:
            leg.finish("error")
            return _err(f"data-parallel engine {body['data_parallel_rank']} is dead", 503)
        if self.behaviour in ("error400", "error500"):
            leg.finish("error")
            status = int(self.behaviour[-3:])
            return _err(f"{self.name} refuses this request", status)
        n = int(body.get("max_tokens") or 4)
        if body.get("stream"):
            kv = self.pull_params if prefill_leg else None  # a streamed P leg's, as engines
            return StreamingResponse(self._sse(leg, n, chat, hold, kv),
                                     media_type="text/event-stream")
        leg.finish("completed")
        text = "".join(f"tok{i} " for i in range(n))
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": "length"}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
        out = {"id": f"cmpl-{self.name}", "object": "chat.completion" if chat else
               "text_completion", "created": 0, "model": MODEL, "choices": [choice],
               "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}}
        if prefill_leg and self.pull_params:
            out["kv_transfer_params"] = self.pull_params
        return JSONResponse(out)

    async def _sse(self, leg: Leg, n: int, chat: bool, hold: str | None,
                   kv_params: dict[str, Any] | None = None):
        try:
            for i in range(n):
                if i == 1 and hold == "after_first":
                    while not self.gate.is_set():
                        await asyncio.sleep(0.01)
                finish = "length" if i == n - 1 else None
                if chat:
                    choice = {"index": 0, "delta": {"content": f"tok{i} "},
                              "finish_reason": finish}
                else:
                    choice = {"index": 0, "text": f"tok{i} ", "logprobs": None,
                              "finish_reason": finish}
                chunk = {"id": f"cmpl-{self.name}", "created": 0, "model": MODEL,
                         "object": "chat.completion.chunk" if chat else "text_completion",
                         "choices": [choice]}
                yield f"data: {json.dumps(chunk)}\n\n"
                leg.chunks_sent += 1
                await asyncio.sleep(self.token_interval)
            if kv_params:
                yield f"data: {json.dumps({'kv_transfer_params': kv_params})}\n\n"
            yield "data: [DONE]\n\n"
            while hold == "after_done" and not self.gate.is_set():
                await asyncio.sleep(0.01)
            leg.finish("completed")
        finally:
            leg.finish("cancelled")


@dataclass
class Proxy:
    url: str
    app: FastAPI
    client: httpx.Client  # one client per test: a fresh httpx.Client per call is slow

    @property
    def state(self):
        return self.app.state.proxy

    def healthy(self, url: str) -> bool:
        return any(b.healthy for pool in (self.state.prefill, self.state.decode)
                   for b in pool.backends if b.url == url)

    def metrics(self) -> str:
        key = self.state.config.api_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return self.client.get(self.url + "/metrics", headers=headers, timeout=5).text


class Cluster:
    def __init__(self, stack: contextlib.ExitStack) -> None:
        self.stack = stack
        self._ports = 5600
        self._servers: list[ServerThread] = []
        self.fakes: list[FakeBackend] = []
        self.proxies: list[Proxy] = []
        stack.callback(self._stop_all)

    def assert_no_leg_left(self) -> None:
        """Invariant: once every backend has answered, no lease is left outstanding."""
        for fake in self.fakes:
            fake.gate.set()
        for proxy in self.proxies:
            pools = (proxy.state.prefill, proxy.state.decode)
            wait_until(lambda pools=pools: all(b.outstanding == 0 for pool in pools
                                               for b in pool.backends),
                       what=f"no outstanding legs on {proxy.url}")

    def _stop_all(self) -> None:
        for server in self._servers:  # all at once: each takes a tick of its loop to notice
            server.server.should_exit = True
        for server in self._servers:
            server.thread.join(10)

    def fake(self, name: str) -> FakeBackend:
        self._ports += 1
        fake = FakeBackend(name, kv_port=self._ports)
        server = ServerThread(fake.app(), name).start()
        self._servers.append(server)
        self.stack.callback(fake.gate.set)  # release held legs before stopping
        fake.url = server.url
        fake.server = server
        self.fakes.append(fake)
        return fake

    def proxy(self, prefills: list[FakeBackend], decodes: list[FakeBackend], **kw: Any) -> Proxy:
        kw.setdefault("health_interval", 0.2)
        kw.setdefault("health_timeout", 1.0)
        kw.setdefault("request_timeout", 15.0)
        config = ProxyConfig(prefill_urls=tuple(p.url for p in prefills),
                             decode_urls=tuple(d.url for d in decodes), **kw)
        app = build_app(config)
        server = ServerThread(app, "proxy").start()
        self._servers.append(server)
        client = httpx.Client(timeout=10)
        self.stack.callback(client.close)
        self.proxies.append(Proxy(server.url, app, client))
        return self.proxies[-1]


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with contextlib.ExitStack() as stack:
        cluster = Cluster(stack)
        yield cluster
        cluster.assert_no_leg_left()


def post(proxy: Proxy, body: dict[str, Any], path: str = "/v1/completions",
         timeout: float = 10.0, **kw: Any) -> httpx.Response:
    return proxy.client.post(proxy.url + path, json=body, timeout=timeout, **kw)


def sse_events(lines: Iterator[str]) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


BODY = {"model": MODEL, "prompt": "hello there", "max_tokens": 4}
CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


# ---- push and pull --------------------------------------------------------------------------


@pytest.mark.parametrize("chat,stream", [(False, False), (True, True)])
def test_push_sends_both_legs_at_once_with_one_request_id_and_transfer_id(
    cluster: Cluster, chat: bool, stream: bool
) -> None:
    """Both legs carry one id and one transfer_id the proxy made; the client's X-Request-Id
    is only echoed back (issue 15: client ids never pair legs)."""
    p, d = cluster.fake("p"), cluster.fake("d")
    p.delay, d.delay = 0.4, 0.2  # sequential legs could not overlap
    proxy = cluster.proxy([p], [d])
    body = dict(CHAT_BODY if chat else BODY, stream=stream)
    if stream:
        body["stream_options"] = {"include_usage": True}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    resp = post(proxy, body, path, headers={"X-Request-Id": "client-req-1"})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-request-id"] == "client-req-1"
    (pleg,), (dleg,) = p.generation_legs(), d.generation_legs()
    assert pleg.wait() == dleg.wait() == "completed"  # P drains after D has answered
    assert pleg.path == dleg.path == path
    assert dleg.started < pleg.finished and pleg.started < dleg.finished  # in flight together
    assert pleg.headers["x-request-id"] == dleg.headers["x-request-id"]
    assert len(pleg.headers["x-request-id"]) == 32 and "client-req-1" not in str(pleg.headers)

    pkv, dkv = pleg.body["kv_transfer_params"], dleg.body["kv_transfer_params"]
    assert pkv == {"do_remote_decode": True, "transfer_id": dkv["transfer_id"]}
    assert len(dkv["transfer_id"]) == 32
    assert dkv == {"do_remote_prefill": True, "remote_engine_id": "engine-p",
                   "remote_host": "127.0.0.1", "remote_port": p.kv_port, "tp_size": 1,
                   "transfer_id": pkv["transfer_id"]}
    # a streaming client's P leg streams too: P's token goes to the client first
    assert pleg.body["max_tokens"] == 1 and pleg.body["stream"] is stream
    assert ("stream_options" in pleg.body) is stream
    assert pleg.body.get("max_completion_tokens") == (1 if chat else None)
    # a streamed D leg asks for token ids (a D dying mid-stream is migrated: proxy/migrate.py)
    assert {k: v for k, v in dleg.body.items() if k != "kv_transfer_params"} == (
        dict(body, return_token_ids=True) if stream else body)
    if stream:
        events = sse_events(resp.text.splitlines())
        assert events[-1] == "[DONE]"
        text = "".join(json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1])
    else:
        text = resp.json()["choices"][0]["text"]
    assert text == "tok0 tok1 tok2 tok3 "


def test_push_makes_fresh_ids_per_request_even_when_the_client_reuses_one(
        cluster: Cluster) -> None:
    p, d = cluster.fake("p"), cluster.fake("d")
    proxy = cluster.proxy([p], [d])
    echoed = {post(proxy, BODY, headers={"X-Request-Id": "same-id"}).headers["x-request-id"]
              for _ in range(3)}
    assert echoed == {"same-id"}
    labels = {post(proxy, BODY).headers["x-request-id"] for _ in range(2)}
    assert len(labels) == 2  # no client id: a fresh label each
    transfer_ids = {leg.body["kv_transfer_params"]["transfer_id"] for leg in d.legs}
    assert len(transfer_ids) == 5
    # P's legs run beside D's: one may reach the fake P after D has answered.
    wait_until(lambda: len(p.legs) == 5, what="five prefill legs")
    engine_ids = {leg.headers["x-request-id"] for leg in p.legs}
    assert engine_ids == {leg.headers["x-request-id"] for leg in d.legs}
    assert len(engine_ids) == 5 and not engine_ids & (labels | echoed)


def test_pull_mode_is_sequential_and_forwards_prefill_kv_params(cluster: Cluster) -> None:
    p, d = cluster.fake("p"), cluster.fake("d")
    p.delay = 0.2
    proxy = cluster.proxy([p], [d], mode="pull")
    resp = post(proxy, dict(BODY, stream=True))
    assert resp.status_code == 200, resp.text
    assert sse_events(resp.text.splitlines())[-1] == "[DONE]"
    (pleg,), (dleg,) = p.legs, d.legs
    assert pleg.finished <= dleg.started
    assert pleg.body["kv_transfer_params"] == {"do_remote_decode": True}
    assert pleg.body["max_tokens"] == 1 and pleg.body["stream"] is True  # like the client's
    assert dleg.body["kv_transfer_params"] == {**p.pull_params, "do_remote_prefill": True}
    assert pleg.headers["x-request-id"] == dleg.headers["x-request-id"]


def test_stream_reaches_client_chunk_by_chunk_before_decode_finishes(cluster: Cluster) -> None:
    p, d = cluster.fake("p"), cluster.fake("d")
    proxy = cluster.proxy([p], [d])
    body = dict(BODY, stream=True, fake_hold="after_first")
    with proxy.client.stream("POST", proxy.url + "/v1/completions", json=body, timeout=10) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"] == "tok0 "
        # the first chunk may be P's (the handover): D's leg can still be on its way
        wait_until(lambda: len(d.legs) == 1, what="D's leg")
        (dleg,) = d.legs
        assert dleg.outcome is None  # D is still holding the rest
        d.gate.set()
        rest = sse_events(lines)
    assert [json.loads(e)["choices"][0]["text"] for e in rest[:-1]] == ["tok1 ", "tok2 ",
                                                                         "tok3 "]
    assert rest[-1] == "[DONE]"
    assert dleg.wait() == "completed"
    assert "pdserve:proxy_ttft_seconds_count 1.0" in proxy.metrics()


def test_stream_ends_at_done_even_if_decode_keeps_its_body_open(cluster: Cluster) -> None:
    p, d = cluster.fake("p"), cluster.fake("d")
    proxy = cluster.proxy([p], [d])
    resp = post(proxy, dict(BODY, stream=True, fake_hold="after_done"))
    assert resp.status_code == 200 and sse_events(resp.text.splitlines())[-1] == "[DONE]"
    assert d.legs[0].wait(10) == "cancelled"  # closed by the proxy after a short drain
    metrics = proxy.metrics()
    assert 'pdserve:proxy_stream_aborts_total{reason="client_disconnect"}' not in metrics
    assert "pdserve:proxy_e2e_request_latency_seconds_count 1.0" in metrics


# ---- choice and health ----------------------------------------------------------------------


def test_least_outstanding_decode_gets_the_next_requests(cluster: Cluster) -> None:
    p, d1, d2 = cluster.fake("p"), cluster.fake("d1"), cluster.fake("d2")
    proxy = cluster.proxy([p], [d1, d2])
    held = threading.Thread(target=post, args=(proxy, dict(BODY, fake_hold="before")),
                            name="held-request", daemon=True)
    held.start()
    wait_until(lambda: len(d1.legs) + len(d2.legs) == 1, what="the held leg")
    busy, idle = (d1, d2) if d1.legs else (d2, d1)
    assert f'pdserve:proxy_outstanding_requests{{url="{busy.url}"}} 1.0' in proxy.metrics()
    for _ in range(3):
        assert post(proxy, BODY).status_code == 200
    assert len(busy.legs) == 1 and len(idle.legs) == 3
    busy.gate.set()
    held.join(10)
    assert busy.legs[0].wait() == "completed"
    # all idle again: ties share the load
    for _ in range(4):
        assert post(proxy, BODY).status_code == 200
    assert len(busy.legs) == 3 and len(idle.legs) == 5


def test_health_check_takes_a_dead_decode_out_and_puts_it_back(cluster: Cluster) -> None:
    p, d1, d2 = cluster.fake("p"), cluster.fake("d1"), cluster.fake("d2")
    proxy = cluster.proxy([p], [d1, d2])
    d2.health_status = 503
    wait_until(lambda: not proxy.healthy(d2.url), what="d2 out of rotation")
    assert f'pdserve:proxy_backend_healthy{{role="decode",url="{d2.url}"}} 0.0' \
        in proxy.metrics()
    assert proxy.client.get(proxy.url + "/health", timeout=5).status_code == 200
    for _ in range(4):
        assert post(proxy, BODY).status_code == 200
    assert len(d1.legs) == 4 and not d2.legs
    d2.health_status = 200
    wait_until(lambda: proxy.healthy(d2.url), what="d2 back in rotation")
    for _ in range(4):
        assert post(proxy, BODY).status_code == 200
    assert len(d2.legs) == 2


def test_connection_error_takes_decode_out_at_once(cluster: Cluster) -> None:
    """Without retries the client gets the 502 naming the backend; either way the refusing
    decode leaves rotation at once."""
    p, d1, d2 = cluster.fake("p"), cluster.fake("d1"), cluster.fake("d2")
    proxy = cluster.proxy([p], [d1, d2], health_interval=60,  # only the failure can tell
                          retries=0)
    d2.server.stop()
    statuses = [post(proxy, BODY) for _ in range(2)]
    failed = [r for r in statuses if r.status_code != 200]
    assert len(failed) == 1 and failed[0].status_code == 502
    error = failed[0].json()["error"]
    assert d2.url in error["message"] and error["type"] == "server_error"
    assert not proxy.healthy(d2.url)
    assert all(post(proxy, BODY).status_code == 200 for _ in range(3))
    assert len(d1.legs) == 4


def test_a_refused_decode_is_retried_on_another_pair_before_the_client_sees_it(
        cluster: Cluster) -> None:
    p, d1, d2 = cluster.fake("p"), cluster.fake("d1"), cluster.fake("d2")
    proxy = cluster.proxy([p], [d1, d2], health_interval=60)  # retries: the default
    d2.server.stop()
    assert all(post(proxy, BODY).status_code == 200 for _ in range(4))
    assert not proxy.healthy(d2.url) and len(d1.legs) == 4
    m = proxy.metrics()
    assert 'pdserve:proxy_retries_total{reason=' in m and 'role="decode"' in m, [
        ln for ln in m.splitlines() if "retr" in ln or "failure" in ln]


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_without_a_healthy_prefill_decode_computes_the_prompt_alone(cluster: Cluster,
                                                                     mode: str) -> None:
    """A stopped or restarting P (issue 26's soak: 111 honest requests got 503 while P was
    SIGSTOPped) costs a prefill on D, not the request: under --p-failure-policy recompute
    the proxy sends D the plain request."""
    p, d = cluster.fake("p"), cluster.fake("d")
    proxy = cluster.proxy([p], [d], mode=mode)
    p.health_status = 503
    wait_until(lambda: not proxy.healthy(p.url), what="p out of rotation")
    health = proxy.client.get(proxy.url + "/health", timeout=5)
    assert health.status_code == 503 and "prefill" in health.json()["error"]["message"]
    assert post(proxy, BODY).status_code == 200
    assert not p.legs and len(d.legs) == 1
    assert "kv_transfer_params" not in d.legs[0].body
    assert 'pdserve:proxy_prefill_leg_failures_total{action="decode_alone"} 1.0' in (
        proxy.metrics())


def test_no_healthy_backend_is_a_clear_503(cluster: Cluster) -> None:
    p, d = cluster.fake("p"), cluster.fake("d")
    proxy = cluster.proxy([p], [d], p_failure_policy="cancel")
    p.health_status = 503
    wait_until(lambda: not proxy.healthy(p.url), what="p out of rotation")
    resp = post(proxy, BODY)
    assert resp.status_code == 503
    assert "no healthy prefill backend" in resp.json()["error"]["message"]
    assert not d.legs
    d.health_status = 503
    wait_until(lambda: not proxy.healthy(d.url), what="d out of rotation")
    resp = post(proxy, BODY)
    assert resp.status_code == 503 and "no healthy" in resp.json()["error"]["message"]


def test_unreadable_kv_info_moves_to_another_prefill(cluster: Cluster) -> None:
    p1, p2, d = cluster.fake("p1"), cluster.fake("p2"), cluster.fake("d")
    p1.info_status = 500
    proxy = cluster.proxy([p1, p2], [d], health_interval=60)
    for _ in range(2):
        assert post(proxy, BODY).status_code == 200
    # push sends both legs at once: D's answer may come back before P's second leg lands
    wait_until(lambda: len(p2.legs) == 2, what="both prefill legs on p2")
    assert not p1.legs and len(p2.legs) == 2
    assert {leg.body["kv_transfer_params"]["remote_engine_id"] for leg in d.legs} == {
        "engine-p2"}


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_data_parallel_prefill_legs_name_the_rank(cluster: Cluster, mode: str) -> None:
    """A P whose /kv_transfer/info lists data_parallel_ranks: each P leg is pinned to one
    rank (least outstanding, ties round-robin), a push D leg names that rank's engine id and
    side channel; a rank that fails is re-read as dead and gets no more legs."""
    p, d = cluster.fake("p"), cluster.fake("d")
    p.dp_size = 2
    # no retries: the failed rank-1 leg falls to the P-failure policy (D recomputes) at once
    proxy = cluster.proxy([p], [d], mode=mode, health_interval=60, retries=0)
    for _ in range(4):
        assert post(proxy, BODY).status_code == 200
    wait_until(lambda: len(p.legs) == 4, what="four prefill legs")
    assert [leg.body["data_parallel_rank"] for leg in p.legs] == [0, 1, 0, 1]
    if mode == "push":
        assert [(leg.body["kv_transfer_params"]["remote_engine_id"],
                 leg.body["kv_transfer_params"]["remote_port"]) for leg in d.legs] == [
            ("engine-p_dp0", p.kv_port), ("engine-p_dp1", p.kv_port + 1)] * 2
    p.dead_ranks, d.delay = {1}, 0.3  # D answers after P's failure is seen (push)
    for _ in range(4):  # the leg to rank 1 fails (D recomputes), then rank 0 takes all
        assert post(proxy, BODY).status_code == 200
    wait_until(lambda: len(p.legs) == 8, what="eight prefill legs")
    assert [leg.body["data_parallel_rank"] for leg in p.legs[4:]] == [0, 1, 0, 0]
    assert all(b.rank_outstanding.get(r, 0) == 0 for b in proxy.state.prefill.backends
               for r in (0, 1))


@pytest.mark.parametrize("ranks, error", [
    ("x", "data_parallel_ranks is not a list"),
    ([{"engine_id": "e", "kv_host": "h", "kv_port": 1}], "data_parallel_ranks[0] lacks 'rank'"),
    ([{"rank": 0, "engine_id": "", "kv_host": "h", "kv_port": 1}], "bad engine_id/kv_host"),
    ([{"rank": -1, "engine_id": "e", "kv_host": "h", "kv_port": 1}], "bad rank=-1"),
])
def test_malformed_data_parallel_ranks_are_named(ranks: Any, error: str) -> None:
    info = {**FakeBackend("p").info(), "data_parallel_ranks": ranks}
    with pytest.raises(KVInfoError, match=re.escape(error)):
        PrefillCoordinates.from_json(info, "http://p")


def test_prefill_without_ranks_gets_no_rank_pinned(cluster: Cluster) -> None:
    p, d = cluster.fake("p"), cluster.fake("d")
    proxy = cluster.proxy([p], [d], mode="pull")
    assert post(proxy, BODY).status_code == 200
    p.info_status = 404  # a P without /kv_transfer/info still works in pull mode
    proxy.state.dispatcher.kv_info.invalidate(p.url)
    for _ in range(2):
        assert post(proxy, BODY).status_code == 200
    assert all("data_parallel_rank" not in leg.body for leg in p.legs)


# ---- failures -------------------------------------------------------------------------------


def test_prefill_failure_under_recompute_lets_decode_answer(cluster: Cluster) -> None:
    p, d = cluster.fake("p"), cluster.fake("d")
    p.behaviour, d.delay = "error500", 0.3
    proxy = cluster.proxy([p], [d], retries=0)  # the policy after the last try, at once
    resp = post(proxy, BODY)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"].startswith("tok0")
    assert d.legs[0].outcome == "completed"
    assert 'pdserve:proxy_prefill_leg_failures_total{action="recompute"} 1.0' \
        in proxy.metrics()


def test_prefill_connection_error_takes_it_out_and_decode_recomputes(cluster: Cluster) -> None:
    p1, p2, d = cluster.fake("p1"), cluster.fake("p2"), cluster.fake("d")
    proxy = cluster.proxy([p1, p2], [d], health_interval=60,  # only the failure can tell
                          retries=0)  # the failed leg falls to the recompute policy at once
    for _ in range(2):  # both P's coordinates are cached now
        assert post(proxy, BODY).status_code == 200
    # push sends both legs at once: D may answer before a P leg lands, so wait on the legs
    wait_until(lambda: len(p1.legs) + len(p2.legs) == 2, what="the first two prefill legs")
    p1.server.stop()
    for sent in range(1, 4):
        assert post(proxy, BODY).status_code == 200  # D answers in any case
        # settled: every prefill leg sent since the stop landed on p2 or failed on p1
        wait_until(lambda n=sent: len(p2.legs) - 1 + (not proxy.healthy(p1.url)) == n,
                   what=f"prefill leg {sent} after the stop settled")
    assert not proxy.healthy(p1.url) and proxy.healthy(p2.url)
    # one of the three went to the dead P (no leg arrived), the next two to p2
    assert len(p1.legs) == 1 and len(p2.legs) == 3 and len(d.legs) == 5
    assert f'reason="connection",role="prefill",url="{p1.url}"' in proxy.metrics()


@pytest.mark.parametrize("policy", ["recompute", "cancel"])
def test_pull_mode_prefill_failure_follows_the_policy(cluster: Cluster, policy: str) -> None:
    p, d = cluster.fake("p"), cluster.fake("d")
    p.behaviour = "error500"
    proxy = cluster.proxy([p], [d], mode="pull", p_failure_policy=policy)
    resp = post(proxy, BODY)
    if policy == "recompute":
        assert resp.status_code == 200
        (dleg,) = d.legs
        assert "kv_transfer_params" not in dleg.body  # D computes the prompt itself
    else:
        assert resp.status_code == 502 and p.url in resp.json()["error"]["message"]
        assert not d.legs


def test_pull_mode_prefill_answer_without_kv_params_is_a_prefill_failure(
    cluster: Cluster,
) -> None:
    p, d = cluster.fake("p"), cluster.fake("d")
    p.pull_params = {}
    proxy = cluster.proxy([p], [d], mode="pull", p_failure_policy="cancel")
    resp = post(proxy, BODY)
    assert resp.status_code == 502
    assert "without kv_transfer_params" in resp.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_prefill_failure_under_cancel_aborts_decode(cluster: Cluster, stream: bool) -> None:
    p, d = cluster.fake("p"), cluster.fake("d")
    p.behaviour, p.after = "error500", d  # fails once D's leg has arrived
    proxy = cluster.proxy([p], [d], p_failure_policy="cancel")
    resp = post(proxy, dict(BODY, stream=stream, fake_hold="before"))
    assert resp.status_code == 502
    error = resp.json()["error"]
    assert p.url in error["message"] and "cancel" in error["message"]
    assert error["code"] == "prefill_failed"
    assert d.legs[0].wait() == "cancelled"


def test_prefill_failure_under_cancel_mid_stream_ends_with_error_event(cluster: Cluster) -> None:
    p, d = cluster.fake("p"), cluster.fake("d")
    p.behaviour, p.after, p.delay = "error500", d, 0.3  # fails after D's first chunk
    proxy = cluster.proxy([p], [d], p_failure_policy="cancel")
    resp = post(proxy, dict(BODY, stream=True, fake_hold="after_first"))
    assert resp.status_code == 200
    events = sse_events(resp.text.splitlines())
    assert json.loads(events[0])["choices"][0]["text"] == "tok0 "
    assert p.url in json.loads(events[1])["error"]["message"]
    assert events[-1] == "[DONE]"
    assert d.legs[0].wait() == "cancelled"


def test_prefill_bad_request_goes_to_client_and_cancels_decode(cluster: Cluster) -> None:
    p, d = cluster.fake("p"), cluster.fake("d")
    p.behaviour, p.after = "error400", d
    proxy = cluster.proxy([p], [d])  # even under recompute
    resp = post(proxy, dict(BODY, fake_hold="before"))
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "p refuses this request"
    assert d.legs[0].wait() == "cancelled"
    assert proxy.healthy(p.url)


def test_decode_failure_is_a_clear_error_and_cancels_prefill(cluster: Cluster) -> None:
    p, d = cluster.fake("p"), cluster.fake("d")
    p.behaviour, d.behaviour = "hang", "error500"
    d.after = p  # P's leg has arrived when D fails
    proxy = cluster.proxy([p], [d])
    resp = post(proxy, BODY)
    assert resp.status_code == 502
    error = resp.json()["error"]
    assert f"decode backend {d.url} answered 500" in error["message"]
    assert "d refuses this request" in error["message"]
    assert p.legs[0].wait() == "cancelled"
    assert f'reason="http_500",role="decode",url="{d.url}"' in proxy.metrics()


def test_decode_bad_request_passes_through(cluster: Cluster) -> None:
    p, d = cluster.fake("p"), cluster.fake("d")
    d.behaviour = "error400"
    proxy = cluster.proxy([p], [d])
    resp = post(proxy, BODY)
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "d refuses this request"
    assert proxy.healthy(d.url)


@pytest.mark.parametrize("hold", ["before", "after_first"])
def test_client_disconnect_cancels_both_legs(cluster: Cluster, hold: str) -> None:
    p, d = cluster.fake("p"), cluster.fake("d")
    p.behaviour = "hang"
    proxy = cluster.proxy([p], [d])
    payload = json.dumps(dict(BODY, stream=True, fake_hold=hold)).encode()
    port = int(proxy.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        wait_until(lambda: p.legs and d.legs, what="both legs")
        if hold == "after_first":
            received = b""
            while b"data: " not in received:
                received += conn.recv(65536)
            assert received.startswith(b"HTTP/1.1 200")
    # the client has gone
    assert p.legs[0].wait() == "cancelled"
    assert d.legs[0].wait() == "cancelled"


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_client_gone_while_the_proxy_awaits_kv_info_frees_the_prefill_lease(
        cluster: Cluster, mode: str) -> None:
    """P's /kv_transfer/info is slow (its timeout is long): a client that leaves meanwhile
    ends its request at once, and P's lease with it; no leg is sent."""
    p, d = cluster.fake("p"), cluster.fake("d")
    p.info_hold = True
    proxy = cluster.proxy([p], [d], mode=mode, health_timeout=30.0)
    backend = proxy.state.prefill.backends[0]
    payload = json.dumps(dict(BODY, stream=True)).encode()
    port = int(proxy.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        wait_until(lambda: p.info_calls and backend.outstanding == 1,
                   what="the proxy to hold P's lease while it asks P's kv info")
    # the client has gone, P's info still hangs
    wait_until(lambda: backend.outstanding == 0, timeout=3.0, what="P's lease to be released")
    assert not p.generation_legs() and not d.generation_legs()


def test_request_timeout_bounds_a_hung_request(cluster: Cluster) -> None:
    p, d = cluster.fake("p"), cluster.fake("d")
    p.behaviour = "hang"
    proxy = cluster.proxy([p], [d], request_timeout=1.5)
    t0 = time.monotonic()
    resp = post(proxy, dict(BODY, fake_hold="before"))
    assert resp.status_code == 504 and time.monotonic() - t0 < 4.0
    assert resp.json()["error"]["code"] == "timeout"
    assert p.legs[0].wait() == "cancelled" and d.legs[0].wait() == "cancelled"


def test_request_timeout_mid_stream_ends_with_a_timeout_event(cluster: Cluster) -> None:
    """D stalls after its first chunk: at the request's deadline the client gets the timeout
    in-band (an error event, then [DONE]) and D's leg is aborted."""
    p, d = cluster.fake("p"), cluster.fake("d")
    proxy = cluster.proxy([p], [d], request_timeout=1.5)
    t0 = time.monotonic()
    resp = post(proxy, dict(BODY, stream=True, fake_hold="after_first"))
    assert resp.status_code == 200 and 1.4 < time.monotonic() - t0 < 4.0
    events = sse_events(resp.text.splitlines())
    assert json.loads(events[0])["choices"][0]["text"] == "tok0 "
    assert json.loads(events[1])["error"]["code"] == "timeout" and events[-1] == "[DONE]"
    assert d.legs[0].wait() == "cancelled"
    assert 'pdserve:proxy_stream_aborts_total{reason="timeout"} 1.0' in proxy.metrics()


def test_legs_waiting_for_a_pool_slot_are_not_connect_timeouts(cluster: Cluster) -> None:
    """More legs than --max-connections: a leg waits for a slot for as long as the request's
    deadline allows, not the connect timeout (a burst of 600 streams ended in 504s and
    backends counted as failing)."""
    p, d = cluster.fake("p"), cluster.fake("d")
    proxy = cluster.proxy([p], [d], max_connections=1, connect_timeout=0.3)
    held = threading.Thread(target=post, args=(proxy, dict(BODY, stream=True,
                                                           fake_hold="after_first")))
    held.start()  # its D leg keeps the one connection
    wait_until(lambda: d.legs and d.legs[0].chunks_sent, what="the held stream's first chunk")
    waiting = concurrent.futures.ThreadPoolExecutor(1).submit(post, proxy, BODY)
    time.sleep(1.0)  # well past the connect timeout: the second request's D leg waits
    # aiohttp reuses P's idle connection past the limit; D's leg needs a new one and waits
    assert len(d.legs) == 1 and not waiting.done()
    d.gate.set()
    held.join(10)
    assert waiting.result(10).status_code == 200
    assert proxy.healthy(p.url) and proxy.healthy(d.url)
    assert "decode_timeout" not in proxy.metrics() and "prefill_timeout" not in proxy.metrics()


def test_generation_routes_answer_other_methods_405_and_time_their_hop(
        cluster: Cluster) -> None:
    """The two POST routes bypass FastAPI's stack (proxy/app.py ProxyApp): other methods still
    get a 405 naming POST, and a relayed answer is still timed in proxy_hop_seconds."""
    p, d = cluster.fake("p"), cluster.fake("d")
    proxy = cluster.proxy([p], [d])
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = proxy.client.get(proxy.url + path, timeout=5)
        assert r.status_code == 405 and r.headers["allow"] == "POST", r.text
    assert post(proxy, dict(BODY, stream=True)).status_code == 200
    assert 'pdserve:proxy_hop_seconds_count{part="relay"} 1.0' in proxy.metrics()


# ---- the client-facing surface ---------------------------------------------------------------


def test_api_key_is_required_and_passed_to_backends(cluster: Cluster) -> None:
    p, d = cluster.fake("p"), cluster.fake("d")
    proxy = cluster.proxy([p], [d], api_key="sekret")
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        resp = post(proxy, BODY, headers=headers)
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == "invalid_api_key"
    assert proxy.client.get(proxy.url + "/v1/models", timeout=5).status_code == 401
    assert not p.legs and not d.legs
    assert proxy.client.get(proxy.url + "/health", timeout=5).status_code == 200
    resp = post(proxy, BODY, headers={"Authorization": "Bearer sekret"})
    assert resp.status_code == 200
    wait_until(lambda: len(p.legs) == 1, what="the prefill leg")  # push: beside D's leg
    assert p.legs[0].headers["authorization"] == d.legs[0].headers["authorization"] \
        == "Bearer sekret"
    assert '{route="/v1/completions",status="401"} 2.0' in proxy.metrics()


@pytest.mark.parametrize("public_metrics", [False, True])
def test_api_key_guards_every_route_but_health(cluster: Cluster, public_metrics: bool) -> None:
    p, d = cluster.fake("p"), cluster.fake("d")
    proxy = cluster.proxy([p], [d], api_key="sekret", public_metrics=public_metrics)
    routes = [("POST", "/v1/completions", BODY), ("POST", "/v1/chat/completions", CHAT_BODY),
              ("GET", "/v1/models", None), ("GET", "/metrics", None)]
    key = {"Authorization": "Bearer sekret"}
    for method, path, body in routes:
        open_route = path == "/metrics" and public_metrics
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = proxy.client.request(method, proxy.url + path, json=body, headers=headers,
                                     timeout=5)
            assert r.status_code == (200 if open_route else 401), (path, headers, r.text)
        r = proxy.client.request(method, proxy.url + path, json=body, headers=key, timeout=5)
        assert r.status_code == 200, (path, r.text)
    assert proxy.client.get(proxy.url + "/health", timeout=5).status_code == 200


def test_bad_bodies_are_4xx_and_send_no_leg(cluster: Cluster) -> None:
    p, d = cluster.fake("p"), cluster.fake("d")
    proxy = cluster.proxy([p], [d], max_body_bytes=4096)
    for content in (b"{not json", b"[1, 2]", b""):
        resp = proxy.client.post(proxy.url + "/v1/completions", content=content, timeout=5,
                          headers={"content-type": "application/json"})
        assert resp.status_code == 400, content
        assert resp.json()["error"]["type"] == "invalid_request_error"
    resp = post(proxy, dict(BODY, prompt="x" * 5000))
    assert resp.status_code == 413
    assert proxy.client.get(proxy.url + "/nope", timeout=5).json()["error"]["code"] == "not_found"
    assert not p.legs and not d.legs


def test_openai_client_works_through_the_proxy(cluster: Cluster) -> None:
    p, d = cluster.fake("p"), cluster.fake("d")
    proxy = cluster.proxy([p], [d])
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0,
                           timeout=10)
    assert [m.id for m in client.models.list()] == [MODEL]
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
    assert out.choices[0].text == "tok0 tok1 tok2 "
    stream = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, stream=True)
    assert "".join(c.choices[0].text for c in stream) == "tok0 tok1 tok2 "
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.choices[0].message.content == "tok0 tok1 "
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == "tok0 tok1 "
    assert len(p.generation_legs()) == len(d.generation_legs()) == 4
    metrics = proxy.metrics()
    for name in ('pdserve:proxy_requests_total{route="/v1/completions",status="200"} 2.0',
                 'pdserve:proxy_requests_total{route="/v1/chat/completions",status="200"} 2.0',
                 f'pdserve:proxy_backend_healthy{{role="prefill",url="{p.url}"}} 1.0',
                 "pdserve:proxy_ttft_seconds_count 4.0",
                 f'pdserve:proxy_outstanding_requests{{url="{d.url}"}} 0.0'):
        assert name in metrics, name
    p.behaviour, p.delay = "error400", 0.0
    with pytest.raises(openai.BadRequestError, match="p refuses this request"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=3,
                                  extra_body={"fake_hold": "before"})


def test_python_m_proxy_serves_requests(cluster: Cluster) -> None:
    p, d = cluster.fake("p"), cluster.fake("d")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "proxy", "--prefill", p.url, "--decode", d.url,
           "--port", str(port), "--health-interval", "0.5", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            assert proc.poll() is None, proc.stdout.read().decode()
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(url + "/health", timeout=1).status_code == 200
            return False

        wait_until(up, timeout=20, what="the proxy process")
        resp = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == (
            "tok0 tok1 tok2 tok3 ")
        assert d.legs[0].body["kv_transfer_params"]["remote_engine_id"] == "engine-p"
    finally:
        proc.terminate()
        proc.wait(10)
    assert proc.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled


def test_cli_rejects_bad_arguments() -> None:
    cmd = [sys.executable, "-m", "proxy", "--prefill", "nonsense", "--decode",
           "http://127.0.0.1:1"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "http://host:port" in out.stderr


# ---- pure parts -----------------------------------------------------------------------------


def test_config_rejects_what_cannot_work() -> None:
    ok = {"prefill_urls": ("http://a:1",), "decode_urls": ("http://b:2/",)}
    assert ProxyConfig(**ok).decode_urls == ("http://b:2",)
    for bad in ({"prefill_urls": ()}, {"decode_urls": ("b:2",)}, {"mode": "both"},
                {"p_failure_policy": "retry"}, {"request_timeout": 0},
                {"prefill_urls": ("http://a:1", "http://a:1/")}):
        with pytest.raises(ValueError):
            ProxyConfig(**{**ok, **bad})


def test_prefill_leg_body_cuts_the_request_down_without_touching_it() -> None:
    body = {"model": MODEL, "messages": [], "max_tokens": 50, "stream": True, "n": 2,
            "stream_options": {"include_usage": True}, "min_tokens": 5,
            "kv_transfer_params": {"client": "junk"}}
    original = json.loads(json.dumps(body))
    leg = prefill_leg_body(body, CHAT, push_prefill_params("t1"))
    assert body == original
    assert leg == {"model": MODEL, "messages": [], "max_tokens": 1, "max_completion_tokens": 1,
                   "stream": False, "n": 1, "min_tokens": 1,  # P samples token 1 as D would
                   "kv_transfer_params": {"do_remote_decode": True, "transfer_id": "t1"}}
    assert "kv_transfer_params" not in decode_leg_body(body, None)
    assert pull_decode_params({"kv_transfer_params": {"remote_block_ids": [1]}}) == {
        "remote_block_ids": [1], "do_remote_prefill": True}
    assert pull_decode_params({"kv_transfer_params": None}) is None
    assert pull_decode_params({"kv_transfer_params": {"do_remote_decode": True, "x": 1}}) == {
        "x": 1, "do_remote_prefill": True}


def test_pool_prefers_fewest_outstanding_then_round_robin() -> None:
    pool = BackendPool("decode", ["http://a:1", "http://b:2", "http://c:3"], ProxyMetrics())
    for b in pool.backends:
        pool.set_health(b, True)
    first = [pool.choose() for _ in range(3)]
    assert [lease.url for lease in first] == ["http://a:1", "http://b:2", "http://c:3"]
    first[1].release()
    first[1].release()  # idempotent
    assert pool.choose().url == "http://b:2"  # the only one with fewer legs
    pool.set_health(pool.backends[0], False, "test")
    assert {pool.choose().url for _ in range(4)} == {"http://b:2", "http://c:3"}
    assert pool.choose(exclude=pool.backends[1:]) is None


@pytest.mark.parametrize("chunks,done", [
    ([b'data: {"x": 1}\n\n', b"data: [DONE]\n\n"], True),
    ([b"data: [DO", b"NE]\n", b"\n"], True),
    ([b"data: [DONE]\n"], False),
    ([b"data: x", b"data: [DONE]\n\n"], False),
    ([b"data: x\r\n\r\ndata: [DONE]\r\n\r\n"], True),
    ([b'data: {"text": "data: [DONE]"}\n\n'], False),
])
def test_done_event_is_found_across_chunk_boundaries(chunks: list[bytes], done: bool) -> None:
    tail = b""
    for chunk in chunks:
        tail = (tail + chunk)[-32:]
    assert ends_with_done_event(tail) is done
