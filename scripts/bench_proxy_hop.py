"""The proxy's own hop (issue 28), apart from the engines: what the push proxy adds to TTFT and
what it costs in CPU per request, against instant fake engines and against the floor, a
do-nothing aiohttp relay on the same loop (uvloop) and parser.

One process plays P and D (aiohttp, answering in the engines' SSE shapes: P its token-1 chunk
after `--p-delay` ms (a stand-in prefill, so D's leg leaves meanwhile, as with real engines),
the kv_transfer_params event and [DONE]; D its stream after `--d-delay` ms, so P's head always
goes first, as in a seeded handover). For each prompt length, rounds of three
streamed completions sent one at a time, in turn, with fresh prompts:
  direct  straight to the fake P (the client's own cost, and the fake's)
  bare    through the do-nothing relay: POST in, the same body out to P, P's first chunk back
  proxy   through `python -m proxy --mode push` (both legs, the handover)
Reported: medians and paired medians of (bare - direct) and (proxy - direct) in ms, the
proxy's pdserve:proxy_hop_seconds means (dispatch, relay), and the CPU seconds per request of
the proxy process and of the bare relay (psutil, over the timed rounds). The CPU model and
load average go in the result.

  .venv/bin/python scripts/bench_proxy_hop.py [--rounds 200] [--lengths 128 1024] [--out F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time

import httpx
import psutil
from bench_first_token import _FROM_TREE, proxy_hop_ms

from engine.net import free_port
from pdserve.bench.machine import cpu_info
from pdserve.launcher import ServerProcess

MODES = ("direct", "bare", "proxy", "baseline")
_INFO = {"engine_id": "engine-P", "kv_host": "127.0.0.1", "kv_port": 5600, "tp_size": 1,
         "block_size": 16, "kv_role": "kv_both", "kv_connector": "NixlPushConnector"}


def _chunk(text: str, finish: str | None, ids: list[int] | None = None,
           prompt: list[int] | None = None) -> bytes:
    choice: dict = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if ids is not None:  # vLLM's return_token_ids, as the engines render it
        choice["token_ids"] = ids
        if prompt is not None:
            choice["prompt_token_ids"] = prompt
    return b"data: " + json.dumps({
        "id": "cmpl-x", "object": "text_completion", "created": 1, "model": "m",
        "choices": [choice]}, separators=(",", ":")).encode() + b"\n\n"


async def _start_app(port: int, health, completions, info=None) -> None:
    """An aiohttp app on 127.0.0.1:port: /health, POST /v1/completions, and
    /kv_transfer/info when given."""
    from aiohttp import web

    app = web.Application()
    app.router.add_get("/health", health)
    if info is not None:
        app.router.add_get("/kv_transfer/info", info)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()


def _serve_fakes(p_port: int, d_port: int, p_delay: float, d_delay: float,
                 gap: float = 0.0) -> None:
    import uvloop
    from aiohttp import web

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    async def info(_: web.Request) -> web.Response:
        return web.json_response(_INFO)

    async def prefill(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        leg = bool((body.get("kv_transfer_params") or {}).get("do_remote_decode"))
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(p_delay)  # P's prefill: D's leg leaves meanwhile, as it does
        await resp.write(_chunk("tok0", "length" if leg else None))
        if leg:
            await resp.write(b'data: {"kv_transfer_params":{"transfer_id":"t"}}\n\n')
        else:
            await resp.write(_chunk(" tok1", "length"))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def decode(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(d_delay)
        n = int(body.get("max_tokens") or 4)
        ids = body.get("return_token_ids") is True
        prompt = body.get("prompt") if isinstance(body.get("prompt"), list) else [5, 6, 7]
        for i in range(n):
            if i and gap:
                await asyncio.sleep(gap)  # D's steps: one event a step
            await resp.write(_chunk(f"tok{i}" if i == 0 else f" tok{i}",
                                    "length" if i == n - 1 else None,
                                    [100 + i] if ids else None,
                                    prompt if ids and i == 0 else None))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def main() -> None:
        for port, gen in ((p_port, prefill), (d_port, decode)):
            await _start_app(port, health, gen, info)
        await asyncio.Event().wait()

    uvloop.run(main())


def _serve_bare(port: int, p_url: str) -> None:
    """The floor: a relay that does nothing but pass the body on and P's stream back."""
    import aiohttp
    import uvloop
    from aiohttp import web

    async def main() -> None:
        session = aiohttp.ClientSession(auto_decompress=False)

        async def health(_: web.Request) -> web.Response:
            return web.Response()

        async def relay(request: web.Request) -> web.StreamResponse:
            data = await request.read()
            async with session.post(p_url + "/v1/completions", data=data,
                                    headers={"content-type": "application/json"}) as up:
                resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
                await resp.prepare(request)
                async for raw in up.content.iter_any():
                    await resp.write(raw)
            return resp

        await _start_app(port, health, relay)
        await asyncio.Event().wait()

    uvloop.run(main())


_PROFILED = """import cProfile, signal, sys, time
from proxy.cli import run
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # uvicorn raises it again at its end
prof = cProfile.Profile(time.process_time)
prof.enable()
try:
    run(sys.argv[1:])
finally:
    prof.disable()
    prof.dump_stats({out!r})
"""


def _ttft(client: httpx.Client, url: str, body: dict) -> float:
    t0 = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        first = None
        for line in r.iter_lines():
            if first is None and line.startswith("data: {") and '"text":"tok0"' in line:
                first = time.perf_counter() - t0
    assert first is not None, f"no token from {url}"
    return first


def _cpu(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def _spawn(args: list[str], port: int) -> ServerProcess:
    return ServerProcess([sys.executable, *args], "127.0.0.1", port, dict(os.environ), None)


async def _burst(url: str, n: int, tokens: int, rng: random.Random) -> None:
    """n concurrent streamed completions (fresh 64-id prompts), each read to its end."""
    import aiohttp

    async def one(session: aiohttp.ClientSession) -> None:
        body = {"model": "m", "prompt": [rng.randrange(4, 8000) for _ in range(64)],
                "max_tokens": tokens, "temperature": 0.0, "stream": True}
        async with session.post(f"{url}/v1/completions", json=body) as r:
            data = await r.read()
        assert r.status == 200 and data.endswith(b"data: [DONE]\n\n"), data[-200:]
        assert data.count(b'"text":') == tokens and b"token_ids" not in data, data[:400]

    limits = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=limits) as session:
        await asyncio.gather(*(one(session) for _ in range(n)))


def _load_rounds(a: argparse.Namespace, urls: dict[str, str], servers: dict,
                 rng: random.Random) -> dict:
    """CPU ms a request of each relay over --rounds bursts, the relays taking turns."""
    spent = {m: 0.0 for m in servers if m != "bare"}
    for i in range(a.rounds + 1):  # round 0 warms up
        for mode in spent:
            before = _cpu(servers[mode].pid)
            asyncio.run(_burst(urls[mode], a.load, a.tokens, rng))
            if i:
                spent[mode] += _cpu(servers[mode].pid) - before
    per = {m: round(v / (a.rounds * a.load) * 1e3, 3) for m, v in spent.items()}
    print("load", a.load, "tokens", a.tokens, "cpu ms/request", per, flush=True)
    return {"load": {"requests": a.load, "tokens": a.tokens, "gap_ms": a.gap,
                     "cpu_ms_per_request": per}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--p-delay", type=float, default=10.0, help="ms before P's token chunk")
    ap.add_argument("--d-delay", type=float, default=30.0, help="ms before D's first chunk")
    ap.add_argument("--out", default="bench/results/proxy_hop.json")
    ap.add_argument("--baseline-tree", help="also a proxy run from this checkout (PYTHONPATH), "
                    "interleaved: before/after a change in one run")
    ap.add_argument("--profile", help="cProfile (CPU time) of the proxy, written to this file")
    ap.add_argument("--load", type=int, default=0, metavar="N",
                    help="CPU under load instead: N concurrent streamed requests a burst, "
                         "--tokens each, D's events --gap ms apart; --rounds bursts per proxy")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--gap", type=float, default=5.0, help="ms between D's events (--load)")
    ap.add_argument("--fakes", nargs=2, type=int, help=argparse.SUPPRESS)
    ap.add_argument("--bare", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.fakes:
        return _serve_fakes(a.fakes[0], a.fakes[1], a.p_delay / 1e3, a.d_delay / 1e3,
                            a.gap / 1e3 if a.load else 0.0)
    if a.bare:
        return _serve_bare(int(a.bare[0]), a.bare[1])
    p_port, d_port, bare_port, proxy_port, base_port = (free_port() for _ in range(5))
    me = os.path.abspath(__file__)
    fakes = _spawn([me, "--fakes", str(p_port), str(d_port), "--p-delay", str(a.p_delay),
                    "--d-delay", str(a.d_delay), "--gap", str(a.gap),
                    *(("--load", str(a.load)) if a.load else ())],
                   p_port)
    procs = [fakes]
    try:
        fakes.wait_healthy(60)
        p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
        bare = _spawn([me, "--bare", str(bare_port), p_url], bare_port)
        launch = ["-m", "proxy"] if not a.profile else ["-c", _PROFILED.format(out=a.profile)]
        proxy = _spawn([*launch, "--host", "127.0.0.1", "--port", str(proxy_port),
                        "--mode", "push", "--prefill", p_url, "--decode", d_url,
                        "--log-level", "warning"], proxy_port)
        procs += [bare, proxy]
        modes = MODES if a.baseline_tree else MODES[:3]
        if a.baseline_tree:  # the same proxy from another checkout (before a change)
            base = _spawn(["-c", _FROM_TREE.format(tree=os.path.abspath(a.baseline_tree)),
                           "--host", "127.0.0.1", "--port", str(base_port),
                           "--mode", "push", "--prefill", p_url, "--decode", d_url,
                           "--log-level", "warning"], base_port)
            procs.append(base)
            base.wait_healthy(60)
        bare.wait_healthy(60)
        proxy.wait_healthy(60)
        urls = {"direct": p_url, "bare": bare.url, "proxy": proxy.url,
                "baseline": f"http://127.0.0.1:{base_port}"}
        servers = {"bare": bare, "proxy": proxy, **({"baseline": base} if a.baseline_tree
                                                     else {})}
        rng = random.Random(28)
        load_start = os.getloadavg()
        results: dict = {}
        if a.load:
            results = _load_rounds(a, {m: urls[m] for m in servers}, servers, rng)
        with httpx.Client(timeout=60) as client:
            for n in a.lengths if not a.load else ():
                rows: dict[str, list[float]] = {m: [] for m in modes}
                cpu0 = {m: 0.0 for m in servers}
                for i in range(a.rounds + 20):  # 20 warm-up rounds
                    if i == 20:
                        cpu0 = {m: _cpu(s.pid) for m, s in servers.items()}
                    for mode in modes:
                        body = {"model": "m", "prompt": [rng.randrange(4, 8000)
                                                         for _ in range(n)],
                                "max_tokens": 4, "temperature": 0.0, "stream": True}
                        t = _ttft(client, urls[mode], body)
                        if i >= 20:
                            rows[mode].append(t)
                cpu = {m: round((_cpu(s.pid) - cpu0[m]) / a.rounds * 1e3, 3)
                       for m, s in servers.items()}
                med = {m: statistics.median(rows[m]) for m in modes}
                paired = {m: statistics.median(
                    x - d for x, d in zip(rows[m], rows["direct"], strict=True))
                    for m in modes[1:]}
                results[str(n)] = {
                    "median_ttft_ms": {m: round(v * 1e3, 3) for m, v in med.items()},
                    "paired_minus_direct_ms": {m: round(v * 1e3, 3) for m, v in paired.items()},
                    "cpu_ms_per_request": cpu,
                }
                print(n, json.dumps(results[str(n)]), flush=True)
        out = {"rounds": a.rounds, "cpu": cpu_info()["model_name"], "loadavg_at_start": load_start,
               "loadavg_at_end": os.getloadavg(), "proxy_hop_ms": proxy_hop_ms(proxy.url),
               "baseline_tree": a.baseline_tree,
               "baseline_hop_ms": proxy_hop_ms(urls["baseline"]) if a.baseline_tree else None,
               "results": results}
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
        print(json.dumps(out, indent=1))
    finally:
        for s in reversed(procs):
            s.stop()


if __name__ == "__main__":
    main()
