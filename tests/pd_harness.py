"""Start a 1P1D (or 1P2D) deployment with a proxy, as real processes, for tests."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil

from engine.net import free_port
from pdserve.launcher import ServerProcess, launch_server

TEST_ENV = {"OMP_NUM_THREADS": "1", "PDSERVE_DEBUG_ROUTES": "1"}
_MAX_TP = 2  # side-channel ports kept free per engine


@dataclass
class Deployment:
    prefills: list[ServerProcess]
    decodes: list[ServerProcess]
    proxy: ServerProcess | None
    mode: str
    kv_ports: dict[str, int] = field(default_factory=dict)

    @property
    def p(self) -> ServerProcess:
        return self.prefills[0]

    @property
    def d(self) -> ServerProcess:
        return self.decodes[0]

    @property
    def engines(self) -> list[ServerProcess]:
        return self.prefills + self.decodes


def role_args(num_blocks: int, extra: dict[str, Any] | None, connector: str,
              engine_id: str, kv_port: int, *more: str) -> list[str]:
    args = ["--num-kv-blocks", str(num_blocks), "--kv-connector", connector,
            "--engine-id", engine_id, "--kv-port", str(kv_port), "--max-model-len", "1024",
            "--served-model-name", "m",
            "--log-level", "warning", *more]
    if extra:
        args += ["--kv-extra-config", json.dumps(extra)]
    return args


def start_proxy(prefill_urls: list[str], decode_urls: list[str], mode: str,
                *more: str) -> ServerProcess:
    port = free_port()
    argv = [sys.executable, "-m", "proxy", "--host", "127.0.0.1", "--port", str(port),
            "--mode", mode, "--health-interval", "0.5", "--log-level", "warning", *more]
    for url in prefill_urls:
        argv += ["--prefill", url]
    for url in decode_urls:
        argv += ["--decode", url]
    proxy = ServerProcess(argv, "127.0.0.1", port, {**os.environ, **TEST_ENV}, None)
    proxy.wait_healthy(60)
    return proxy


_LOG_DIR = tempfile.mkdtemp(prefix="pdserve-e2e-")
_log_count = itertools.count()


def _log_path(engine_id: str) -> str:
    """A server's own log file: a start-up failure's message ends with its tail."""
    return os.path.join(_LOG_DIR, f"{next(_log_count):03d}-{engine_id}.log")


@contextlib.contextmanager
def deployment(model: str, mode: str = "push", *, num_blocks: int = 512,
               extra: dict[str, Any] | None = None, p_extra: dict[str, Any] | None = None,
               d_extra: dict[str, Any] | None = None, num_decodes: int = 1,
               proxy_args: tuple[str, ...] = (), with_proxy: bool = True,
               engine_args: tuple[str, ...] = (), p_args: tuple[str, ...] = (),
               d_args: tuple[str, ...] = ()) -> Iterator[Deployment]:
    """1P + num_decodes D (+ proxy) on `model`; `engine_args` go to every engine (--dtype …),
    `p_args` / `d_args` to P / the Ds only (--tensor-parallel-size …)."""
    connector = "NixlPushConnector" if mode == "push" else "NixlConnector"
    procs: list[ServerProcess] = []
    try:
        p_port = free_port(count=_MAX_TP)  # a TP engine's rank r listens at kv_port + r
        p = launch_server(model, *role_args(num_blocks, {**(extra or {}), **(p_extra or {})},
                                            connector, "P0", p_port, *engine_args, *p_args),
                          module="prefill", env=TEST_ENV, wait=False, log_path=_log_path("P0"))
        procs.append(p)
        decodes, kv_ports = [], {"P0": p_port}
        for i in range(num_decodes):
            d_port = free_port(count=_MAX_TP)
            kv_ports[f"D{i}"] = d_port
            d = launch_server(model, *role_args(num_blocks,
                                                {**(extra or {}), **(d_extra or {})},
                                                connector, f"D{i}", d_port, *engine_args,
                                                *d_args),
                              module="decode", env=TEST_ENV, wait=False,
                              log_path=_log_path(f"D{i}"))
            procs.append(d)
            decodes.append(d)
        for s in procs:
            s.wait_healthy(180)
        proxy = None
        if with_proxy:
            proxy = start_proxy([p.url], [d.url for d in decodes], mode, *proxy_args)
            procs.append(proxy)
        yield Deployment([p], decodes, proxy, mode, kv_ports)
    finally:
        stop_all(procs)


def stop_all(procs: list[ServerProcess]) -> None:
    """Stop servers side by side (each waits for its own drain), the last started first."""
    with ThreadPoolExecutor(max(1, len(procs))) as pool:
        list(pool.map(lambda s: s.stop(), reversed(procs)))


def wait_until(pred: Callable[[], Any], timeout: float = 5.0, what: str = "condition") -> None:
    """Polls `pred` every 10 ms; fails the test naming `what` after `timeout` seconds."""
    until = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > until:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def engine_stats(server: ServerProcess) -> dict[str, Any]:
    return httpx.get(f"{server.url}/engine_stats", timeout=10).json()


def metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def per_engine(server: ServerProcess, name: str) -> dict[str, float]:
    """Metric `name` of a data-parallel server, by its `engine` label (the rank)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {s.labels["engine"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == name}


def assert_no_leaks(servers: list[ServerProcess], timeout: float = 20.0) -> None:
    """Every engine's blocks are back and every connector table is empty (waits for
    leases, acks and one last engine step to settle)."""
    deadline = time.monotonic() + timeout
    while True:
        bad = {}
        for s in servers:
            st = engine_stats(s)
            tables = {k: v for k, v in st.items()
                      if isinstance(v, int) and k.split("_")[0] in ("p", "d", "sched", "pull")
                      and v}
            if st["num_free_blocks"] != st["num_kv_blocks"] or tables or (
                    st["num_unfinished_requests"]):
                bad[s.url] = {"free": st["num_free_blocks"], "total": st["num_kv_blocks"],
                              "unfinished": st["num_unfinished_requests"], **tables}
        if not bad:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"leak after {timeout}s: {bad}")
        time.sleep(0.25)


def engine_core(server_pid: int) -> psutil.Process:
    """The API server's engine-core child (spawned; not multiprocessing's resource tracker)."""
    cores = [c for c in psutil.Process(server_pid).children()
             if "spawn_main" in " ".join(c.cmdline())]
    assert len(cores) == 1, [c.cmdline() for c in psutil.Process(server_pid).children()]
    return cores[0]
