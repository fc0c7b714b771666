"""Helpers for the push fault tests: deployments with per-engine flags, raw legs, waits.

`cluster()` is `pd_harness.deployment()` with what fault scenarios need on top: command-line
flags and kv extra config per engine (one D may drop registrations while another fails
requests), server logs in a temp dir (their tails are printed when start-up fails), and the
side-channel ports of every engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import psutil
from pd_harness import TEST_ENV, Deployment, assert_no_leaks, engine_stats, role_args, start_proxy
from pd_harness import metric as metric  # re-exported for the fault tests

from engine.net import free_port
from pdserve.launcher import ServerProcess, launch_server

MAX_TOKENS = 8
LOG_DIR = os.environ.get("PDSERVE_FAULT_LOGS") or tempfile.mkdtemp(prefix="pdserve-faults-")


@contextlib.contextmanager
def cluster(model: str, *, num_blocks: int = 256, extra: dict[str, Any] | None = None,
            p_extra: dict[str, Any] | None = None,
            d_extras: list[dict[str, Any]] | None = None, p_args: tuple[str, ...] = (),
            d_args: list[tuple[str, ...]] | None = None, proxy_args: tuple[str, ...] = (),
            with_proxy: bool = True, name: str = "faults") -> Iterator[Deployment]:
    """One P and len(d_extras) D's (default one), push mode, optionally behind a proxy."""
    d_extras = d_extras if d_extras is not None else [{}]
    d_args = d_args if d_args is not None else [() for _ in d_extras]
    procs: list[ServerProcess] = []
    kv_ports: dict[str, int] = {}

    def start(module: str, engine_id: str, cfg: dict[str, Any], more: tuple[str, ...]
              ) -> ServerProcess:
        kv_ports[engine_id] = free_port(count=2)  # a TP=2 rank r listens at kv_port + r
        s = launch_server(model, *role_args(num_blocks, {**(extra or {}), **cfg},
                                            "NixlPushConnector", engine_id,
                                            kv_ports[engine_id], *more),
                          module=module, env=TEST_ENV, wait=False,
                          log_path=os.path.join(LOG_DIR, f"{name}-{engine_id}.log"))
        procs.append(s)
        return s

    try:
        p = start("prefill", "P0", p_extra or {}, p_args)
        decodes = [start("decode", f"D{i}", cfg, more)
                   for i, (cfg, more) in enumerate(zip(d_extras, d_args, strict=True))]
        for s in procs:
            s.wait_healthy(180)
        proxy = None
        if with_proxy:
            proxy = start_proxy([p.url], [d.url for d in decodes], "push", *proxy_args)
            procs.append(proxy)
        yield Deployment([p], decodes, proxy, "push", kv_ports)
    finally:
        # Stop side by side: each stop may wait seconds for a graceful drain.
        with ThreadPoolExecutor(max(1, len(procs))) as pool:
            list(pool.map(lambda s: s.stop(10), reversed(procs)))


def prompts(n: int, seed: int, lo: int = 20, hi: int = 120) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 2000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def legs(dep: Deployment, prompt: list[int], tid: str | None, *,
         max_tokens: int = MAX_TOKENS, remote_port: int | None = None, stream: bool = False
         ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The proxy's two push legs for one prompt (P leg, D leg), built by hand. `tid` None:
    vLLM's push protocol, no transfer_id (the legs must then share one X-Request-Id)."""
    info = httpx.get(f"{dep.p.url}/kv_transfer/info", timeout=5).json()
    with_tid = {} if tid is None else {"transfer_id": tid}
    p_leg = {"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
             "kv_transfer_params": {"do_remote_decode": True, **with_tid}}
    d_leg = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
             "stream": stream,
             "kv_transfer_params": {
                 "do_remote_prefill": True, **with_tid,
                 "remote_engine_id": info["engine_id"], "remote_host": info["kv_host"],
                 "remote_port": remote_port or info["kv_port"], "tp_size": info["tp_size"]}}
    return p_leg, d_leg


def both_legs(dep: Deployment, d: ServerProcess, prompt: list[int], tid: str, **kw: Any
              ) -> tuple[httpx.Response, float]:
    """Send both legs at once (as the proxy does), the D leg to `d`; D's response and its
    latency."""
    p_leg, d_leg = legs(dep, prompt, tid, **kw)

    async def run() -> tuple[httpx.Response, float]:
        started = time.monotonic()
        d_task = asyncio.create_task(post(d.url, d_leg, tid))
        assert (await post(dep.p.url, p_leg, tid)).status_code == 200
        out = await d_task
        return out, time.monotonic() - started

    return asyncio.run(run())


def plain(prompt: list[int], max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    return {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}


async def post(url: str, body: dict[str, Any], rid: str, timeout: float = 60.0
               ) -> httpx.Response:
    async with httpx.AsyncClient(timeout=timeout) as c:
        return await c.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": rid})


def post_sync(url: str, body: dict[str, Any], rid: str, timeout: float = 60.0
              ) -> httpx.Response:
    return asyncio.run(post(url, body, rid, timeout))


def text_of(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def wait_for(cond: Callable[[], Any], timeout: float, what: str, every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


def kv_stat(server: ServerProcess, name: str) -> float:
    return float(engine_stats(server)["kv_connector"].get(name, 0))


def table(server: ServerProcess, name: str) -> int:
    return int(engine_stats(server).get(name, 0))


def processes(server: ServerProcess) -> list[psutil.Process]:
    """The server process and everything under it (EngineCore, ...)."""
    try:
        return [psutil.Process(server.pid), *server.descendants()]
    except psutil.NoSuchProcess:
        return []


def signal_all(server: ServerProcess, sig: int) -> None:
    for proc in processes(server):
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(sig)


async def stream_sse(url: str, body: dict[str, Any], rid: str, timeout: float = 60.0
                     ) -> tuple[str, str | None]:
    """POST a streaming completion; (text, error message or None). A connection that breaks
    or a stream that ends without `[DONE]` counts as an error too."""
    text, error, done = [], None, False
    try:
        async with httpx.AsyncClient(timeout=timeout) as c, c.stream(
                "POST", f"{url}/v1/completions", json={**body, "stream": True},
                headers={"X-Request-Id": rid}) as r:
            if r.status_code != 200:
                raw = await r.aread()
                try:
                    return "", json.loads(raw)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    return "", f"HTTP {r.status_code}: {raw[:200]!r}"
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    error = event["error"].get("message", str(event["error"]))
                    continue
                text.append(event["choices"][0].get("text", ""))
    except httpx.HTTPError as e:
        return "".join(text), f"{type(e).__name__}: {e}"
    if error is None and not done:
        error = "stream ended without [DONE]"
    return "".join(text), error


DEFAULT_HEARTBEAT_S = 30.0 / 6  # the default lease / 6


def assert_d_recovered_from_p_death(d: ServerProcess, results: list, expected: list[str],
                                    num_blocks: int, killed: float, *, within_s: float,
                                    peers_gone: int) -> None:
    """After P died mid-transfer: every request answered right (D recomputed), D has every
    block back within two heartbeats of its probes (no quarantine left), `within_s` after the
    kill, with no leak, and its probes saw at least `peers_gone` P agents gone."""
    assert [error for _, error in results] == [None] * len(expected)
    assert [text for text, _ in results] == expected
    wait_for(lambda: engine_stats(d)["num_free_blocks"] == num_blocks
             and table(d, "d_quarantine") == 0, 2 * DEFAULT_HEARTBEAT_S,
             "D to free every block P could have written")
    assert time.monotonic() - killed < within_s
    assert_no_leaks([d], timeout=1)
    assert engine_stats(d)["kv_connector"]["kv_peer_gone_total"] >= peers_gone
