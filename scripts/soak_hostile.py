"""Soak of a 1P1D push deployment behind the proxy under honest load, hostile requests, client
hang-ups and one SIGSTOP/SIGCONT of P (issue 26's acceptance; not part of the suite).

    .venv/bin/python scripts/soak_hostile.py [--minutes 10] [--model DIR] [--honest 4]
        [--stop-at 0.33] [--stop-for 8] [--result-json bench/results/soak_hostile.json]

- honest: `--honest` clients send greedy completions (half of them streamed) of prompts
  from a fixed pool whose answers were computed on D alone first; each answer must equal
  its reference, every one must arrive (a lost or wrong honest request fails the soak);
- hostile: one client sends the hostile corpus of tests/hostile_corpus.py (every route,
  every field) to the proxy, P and D in turn, plus D legs a client could send straight to D
  (a random transfer id no P leg carries, a port nobody listens on, a pull-shaped leg):
  every answer must be a 4xx or a 200, never a 5xx or a dropped connection;
- hang-ups: one client opens streams through the proxy and closes them after the first
  chunk or at once;
- at `--stop-at` of the run P's processes get SIGSTOP, and SIGCONT `--stop-for` s later.
At the end every engine's blocks must be back and the proxy must route to P and D again.
Exit status 0 when all of that holds; the summary is printed and written as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from typing import Any

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "faults"))

from fault_kit import processes, stream_sse  # noqa: E402
from hostile_corpus import corpus  # noqa: E402
from pd_harness import assert_no_leaks, deployment  # noqa: E402

SECRET = "soak-kv-secret-0123456789abcdef"


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 2000) for _ in range(rng.randint(16, 200))] for _ in range(n)]


def _body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}


def _hostile_corpus(prompt: list[int], info: dict[str, Any]) -> list[tuple[str, bytes]]:
    """(route, raw body) pairs no honest client sends."""
    kv = {"do_remote_prefill": True, "remote_engine_id": info["engine_id"],
          "remote_host": info["kv_host"], "remote_port": info["kv_port"],
          "tp_size": info["tp_size"]}
    legs = [
        {**_body(prompt, 4), "kv_transfer_params": {**kv, "transfer_id": f"pin-{i}"}}
        for i in range(4)] + [
        {**_body(prompt, 4), "kv_transfer_params": {**kv, "remote_port": 1}},
        {**_body(prompt, 4), "kv_transfer_params": {
            **kv, "remote_request_id": "x", "remote_block_ids": [0, 1],
            "num_prompt_tokens": len(prompt)}},
    ]
    return ([(case.path, case.body) for case in corpus()]
            + [("/v1/completions", json.dumps(leg).encode()) for leg in legs])


async def _honest(client: httpx.AsyncClient, url: str, pool: list[list[int]],
                  refs: list[str], stop: float, stats: Counter, lat: list[float],
                  seed: int) -> None:
    rng = random.Random(seed)
    while time.monotonic() < stop:
        i = rng.randrange(len(pool))
        started = time.monotonic()
        if rng.random() < 0.5:
            text, error = await stream_sse(url, _body(pool[i], 16), f"honest-{seed}-{i}", 120)
        else:
            try:
                r = await client.post(f"{url}/v1/completions", json=_body(pool[i], 16),
                                      timeout=120)
                ok = r.status_code == 200
                text = r.json()["choices"][0]["text"] if ok else ""
                error = None if ok else f"HTTP {r.status_code}: {r.text[:200]}"
            except httpx.HTTPError as e:
                text, error = "", f"{type(e).__name__}: {e}"
        lat.append(time.monotonic() - started)
        if error is not None:
            stats["lost"] += 1
            stats[f"lost: {error[:80]}"] += 1
        elif text != refs[i]:
            stats["wrong"] += 1
        else:
            stats["ok"] += 1


async def _hostile(client: httpx.AsyncClient, targets: list[str],
                   cases: list[tuple[str, bytes]], stop: float, stats: Counter) -> None:
    n = 0
    while time.monotonic() < stop:
        (path, body), url = cases[n % len(cases)], targets[n // len(cases) % len(targets)]
        n += 1
        try:
            r = await client.post(f"{url}{path}", content=body, timeout=120,
                                  headers={"content-type": "application/json"})
            stats[f"hostile {r.status_code // 100}xx"] += 1
        except httpx.HTTPError as e:
            stats["hostile dropped"] += 1
            stats[f"hostile dropped: {type(e).__name__} {url}{path} "
                  f"{body[:60]!r} at {time.monotonic() - stop:.0f} s"] += 1


async def _hang_ups(url: str, pool: list[list[int]], stop: float, stats: Counter) -> None:
    rng = random.Random(7)
    while time.monotonic() < stop:
        try:
            async with httpx.AsyncClient(timeout=60) as c, c.stream(
                    "POST", f"{url}/v1/completions",
                    json={**_body(rng.choice(pool), 64), "stream": True}) as r:
                if rng.random() < 0.5:
                    async for _ in r.aiter_lines():
                        break
            stats["hang-ups"] += 1
        except httpx.HTTPError:
            stats["hang-ups"] += 1
        await asyncio.sleep(0.05)


async def _stop_p(p: Any, at: float, stop_for: float, log: dict[str, float]) -> None:
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    for proc in processes(p):
        proc.send_signal(signal.SIGSTOP)
    log["sigstop_at_s"] = round(time.monotonic() - log["t0"], 1)
    await asyncio.sleep(stop_for)
    for proc in processes(p):
        proc.send_signal(signal.SIGCONT)
    log["sigcont_at_s"] = round(time.monotonic() - log["t0"], 1)


async def _run(dep: Any, args: argparse.Namespace) -> dict[str, Any]:
    pool = _prompts(48, seed=26)
    async with httpx.AsyncClient() as c:
        refs = []
        for p in pool:  # the reference: D alone, no transfer
            r = await c.post(f"{dep.d.url}/v1/completions", json=_body(p, 16), timeout=120)
            refs.append(r.json()["choices"][0]["text"])
        info = (await c.get(f"{dep.p.url}/kv_transfer/info", timeout=10)).json()
    t0 = time.monotonic()
    stop = t0 + args.minutes * 60
    stats: Counter = Counter()
    lat: list[float] = []
    log: dict[str, float] = {"t0": t0}
    corpus = _hostile_corpus(pool[0], info)
    async with httpx.AsyncClient() as client:
        await asyncio.gather(
            *(_honest(client, dep.proxy.url, pool, refs, stop, stats, lat, s)
              for s in range(args.honest)),
            _hostile(client, [dep.proxy.url, dep.p.url, dep.d.url], corpus, stop, stats),
            _hang_ups(dep.proxy.url, pool, stop, stats),
            _stop_p(dep.p, t0 + args.stop_at * args.minutes * 60, args.stop_for, log))
    lat.sort()
    return {"minutes": args.minutes, "honest_clients": args.honest,
            "honest_ok": stats["ok"], "honest_lost": stats["lost"],
            "honest_wrong": stats["wrong"],
            "honest_p50_s": round(lat[len(lat) // 2], 3) if lat else None,
            "honest_p99_s": round(lat[int(len(lat) * 0.99)], 3) if lat else None,
            "honest_max_s": round(lat[-1], 3) if lat else None,
            "sigstop_at_s": log.get("sigstop_at_s"), "sigcont_at_s": log.get("sigcont_at_s"),
            "stopped_for_s": args.stop_for,
            "counts": dict(sorted(stats.items()))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--model", default=".models/tiny-llama")
    ap.add_argument("--honest", type=int, default=4)
    ap.add_argument("--stop-at", type=float, default=0.33)
    ap.add_argument("--stop-for", type=float, default=8.0)
    ap.add_argument("--result-json", default="bench/results/soak_hostile.json")
    args = ap.parse_args()
    extra = {"kv_secret": SECRET, "push_registration_timeout": 20.0}
    with deployment(args.model, "push", num_blocks=512, extra=extra,
                    proxy_args=("--request-timeout", "120")) as dep:
        summary = asyncio.run(_run(dep, args))
        try:
            assert_no_leaks(dep.engines, timeout=120)
            summary["blocks_back"] = True
        except AssertionError as e:
            summary["blocks_back"], summary["leak"] = False, str(e)
        health = httpx.get(f"{dep.proxy.url}/health", timeout=10)
        summary["proxy_health_at_end"] = health.status_code
    hostile_bad = sum(v for k, v in summary["counts"].items()
                      if k in ("hostile 5xx", "hostile dropped"))
    summary["passed"] = bool(summary["honest_lost"] == summary["honest_wrong"] == 0
                             and hostile_bad == 0 and summary["blocks_back"]
                             and summary["honest_ok"] > 0
                             and summary["proxy_health_at_end"] == 200)
    print(json.dumps(summary, indent=2))
    if args.result_json:
        os.makedirs(os.path.dirname(args.result_json) or ".", exist_ok=True)
        with open(args.result_json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
