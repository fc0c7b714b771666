"""A stopped process never hangs a request (issue 26, findings 5 and 6).

SIGSTOP freezes a process without ending it: no sentinel fires, no socket closes. The engine
must notice by itself (heartbeats, engine/core/liveness.py), fail the requests with a clear
error within the heartbeat timeout, answer /health 503 naming why, and stay failed after
SIGCONT; the proxy, which reads /health, stops routing to it while the healthy backends go
on serving. And the TP group's rendezvous listens on nothing another host can reach.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from fault_kit import LOG_DIR
from pd_harness import TEST_ENV, role_args, start_proxy, wait_until

from engine.net import free_port
from pdserve.launcher import ServerProcess, launch_server

HB = 5.0  # --heartbeat-timeout of these engines (short: the test waits for it)
BOUND = HB + 12.0  # detection + the kill + a busy 2-core machine
ENGINE = ("--heartbeat-timeout", str(HB), "--served-model-name", "m", "--max-model-len", "512",
          "--log-level", "warning")


def _complete(url: str, max_tokens: int = 8, timeout: float = 60.0) -> tuple[int, str, float]:
    started = time.monotonic()
    r = httpx.post(f"{url}/v1/completions", timeout=timeout,
                   json={"model": "m", "prompt": [5, 6, 7, 8, 9, 10], "max_tokens": max_tokens,
                         "temperature": 0.0, "ignore_eos": True})
    text = r.json()["error"]["message"] if r.status_code != 200 else ""
    return r.status_code, text, time.monotonic() - started


def _health(url: str) -> tuple[int, str]:
    r = httpx.get(f"{url}/health", timeout=5)
    return r.status_code, r.text


def _core_pid(server: ServerProcess) -> int:
    """The server's EngineCore process (its multiprocessing child that is no tracker)."""
    for child in psutil.Process(server.pid).children():
        cmd = " ".join(child.cmdline())
        if "spawn_main" in cmd:
            return child.pid
    raise AssertionError(f"no EngineCore child of {server.pid}")


def _cont(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # already killed and reaped
        os.kill(pid, signal.SIGCONT)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_stopped_tp_worker_fails_requests_and_health_names_it(tiny_model: str) -> None:
    with launch_server(tiny_model, "--tensor-parallel-size", "2", "--num-kv-blocks", "64",
                       *ENGINE, env=TEST_ENV,
                       log_path=os.path.join(LOG_DIR, "stuck-tp.log")) as s:
        assert _complete(s.url)[0] == 200
        pids = httpx.get(f"{s.url}/engine_stats", timeout=10).json()["tp_worker_pids"]
        os.kill(pids[1], signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(4) as pool:
                results = list(pool.map(lambda _: _complete(s.url, 64), range(4)))
            for status, message, took in results:
                assert status == 503, (status, message)
                assert "tensor-parallel worker 1" in message and "not responding" in message
                assert took < BOUND, f"a request took {took:.1f}s"
            status, body = _health(s.url)
            assert status == 503 and "tensor-parallel worker 1" in body, body
        finally:
            _cont(pids[1])
        # Stays failed: the stopped worker was killed, SIGCONT brings nothing back.
        wait_until(lambda: all(_gone(p) for p in pids), 10, "the TP workers to be gone")
        assert _health(s.url)[0] == 503
        assert _complete(s.url)[0] == 503


def test_stopped_prefill_core_leaves_rotation_and_its_requests_fail_fast(
        tiny_model: str) -> None:
    servers: list[ServerProcess] = []
    try:
        for name in ("P0", "P1"):
            servers.append(launch_server(
                tiny_model, *role_args(128, None, "NixlPushConnector", name,
                                       free_port(count=2), "--heartbeat-timeout", str(HB)),
                module="prefill", env=TEST_ENV, wait=False,
                log_path=os.path.join(LOG_DIR, f"stuck-{name}.log")))
        servers.append(launch_server(
            tiny_model, *role_args(128, None, "NixlPushConnector", "D0", free_port(count=2)),
            module="decode", env=TEST_ENV, wait=False,
            log_path=os.path.join(LOG_DIR, "stuck-D0.log")))
        for s in servers:
            s.wait_healthy(180)
        p0, p1, d = servers
        proxy = start_proxy([p0.url, p1.url], [d.url], "push")
        servers.append(proxy)
        assert _complete(proxy.url)[0] == 200
        core = _core_pid(p1)
        with ThreadPoolExecutor(8) as pool:
            # Mid-flight: long requests on P1 itself, then its core stops under them.
            inflight = [pool.submit(_complete, p1.url, 400) for _ in range(6)]
            wait_until(lambda: _running(p1) > 0, 30, "P1's requests to be running")
            os.kill(core, signal.SIGSTOP)
            try:
                for fut in inflight:
                    status, message, took = fut.result()
                    assert status == 503 and "not responding" in message, (status, message)
                    assert took < BOUND + 10, f"a request took {took:.1f}s"
                status, body = _health(p1.url)
                assert status == 503 and "engine core 0" in body and "not responding" in body
                wait_until(lambda: _in_rotation(proxy, p1.url) == 0, 10,
                           "the proxy to take P1 out of rotation")
                # Honest requests through the proxy go to the healthy P and succeed.
                honest = list(pool.map(lambda _: _complete(proxy.url), range(6)))
                assert [h[0] for h in honest] == [200] * 6, honest
                assert _in_rotation(proxy, p0.url) == 1
            finally:
                _cont(core)
        wait_until(lambda: _gone(core), 10, "P1's stopped core to be killed")
        assert _health(p1.url)[0] == 503  # stays failed: restart the server to recover
    finally:
        for s in reversed(servers):
            s.stop(10)


def _running(server: ServerProcess) -> float:
    try:
        st = httpx.get(f"{server.url}/engine_stats", timeout=5).json()
    except httpx.HTTPError:
        return 0
    return st["num_running_reqs"]


def _in_rotation(proxy: ServerProcess, url: str) -> float:
    text = httpx.get(f"{proxy.url}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith("pdserve:proxy_backend_healthy{") and f'url="{url}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no backend_healthy sample for {url}")


def _non_loopback_ipv4() -> str:
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    pytest.skip("this host has no non-loopback IPv4 address")


def test_tp_group_listens_on_nothing_another_host_can_reach(tiny_model: str) -> None:
    """An attacker on the network dials every TCP port the engine's processes listen on,
    at this host's non-loopback address: each is refused (before: the TCPStore of the TP
    rendezvous accepted, and took a key write)."""
    outside = _non_loopback_ipv4()
    with launch_server(tiny_model, "--tensor-parallel-size", "2", "--num-kv-blocks", "64",
                       *ENGINE, env=TEST_ENV,
                       log_path=os.path.join(LOG_DIR, "tp-listen.log")) as s:
        assert _complete(s.url)[0] == 200
        procs = [psutil.Process(s.pid), *psutil.Process(s.pid).children(recursive=True)]
        ports = set()
        for p in procs:
            for c in p.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN:
                    ports.add(c.laddr.port)
        assert s.port in ports  # the listing sees the sockets
        reached = []
        for port in sorted(ports):
            with socket.socket() as sock:
                sock.settimeout(2)
                if sock.connect_ex((outside, port)) == 0:
                    reached.append(port)
        assert not reached, f"ports reachable at {outside}: {reached} (of {sorted(ports)})"
        assert _complete(s.url)[0] == 200  # the probes did not disturb the group
