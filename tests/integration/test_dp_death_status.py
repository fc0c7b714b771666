"""A data-parallel rank dies under its requests: they end as the engine being unavailable
(503 `engine_dead`, in a stream its error event), never as a server error (500), so clients
and the proxy see what happened. Issue 26: a request pinned to a rank in the moment before
its death was recorded got a 500 (`request_failed`); so did every request the rank held.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest
from pd_harness import per_engine, wait_until

from pdserve.launcher import ServerProcess, launch_server

LONG = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 500, "ignore_eos": True,
        "data_parallel_rank": 1}


@pytest.fixture(scope="module")
def server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    log = str(tmp_path_factory.mktemp("dp-death") / "server.log")
    with launch_server(tiny_model, "--served-model-name", "m", "--num-kv-blocks", "256",
                       "--max-model-len", "512", "-dp", "2", log_path=log) as s:
        yield s


def test_requests_a_dead_rank_held_end_with_503_not_500(server: ServerProcess) -> None:
    pid = httpx.get(server.url + "/engine_stats", timeout=30).json()["dp_engine_pids"][1]
    plain: dict[str, httpx.Response] = {}
    held = threading.Thread(target=lambda: plain.update(
        r=httpx.post(server.url + "/v1/completions", json=LONG, timeout=120)))
    held.start()
    wait_until(lambda: per_engine(server, "pdserve:num_requests_running").get("1", 0) >= 1,
               timeout=30, what="the plain request running on rank 1")
    events = []
    with httpx.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True},
                      timeout=120) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        events.append(next(ln for ln in lines if ln.startswith("data: ")))
        os.kill(pid, signal.SIGKILL)  # both requests are 1 token into 500
        events += [ln[6:] for ln in lines if ln.startswith("data: ")]
    held.join(60)
    r = plain["r"]
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "engine_dead" and "data-parallel engine 1 died" in error["message"]
    assert events[-1] == "[DONE]"
    streamed = json.loads(events[-2])["error"]
    assert streamed["code"] == "engine_dead" and "engine 1 died" in streamed["message"]
    ok = httpx.post(server.url + "/v1/completions", timeout=60,
                    json={"model": "m", "prompt": "still here", "max_tokens": 2})
    assert ok.status_code == 200
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
