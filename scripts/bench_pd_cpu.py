"""What a disaggregated request costs in CPU (issue 33 item 6): colocated vs 1P1D push.

The same load, one deployment after the other on the same (shared) cores:
  colocated  one engine server answers every request itself;
  pd         P + D (NixlPushConnector) behind the push proxy.
The load: --num-requests streamed completions sent all at once (greedy, --output-len tokens
each, ignore_eos), prompts of 10-80 random words. Measured for each deployment over the load
only (start-up excluded): the wall time from the first request sent to the last stream ended,
and each server's CPU seconds (user + system of its whole process tree: the API server, its
EngineCore, anything they spawned), with the threads that spent the most (name, CPU s) so
it shows where the time goes. Checked: every request answered, the P/D answers equal the
colocated ones, and every KV block back on every engine afterwards.

--env KEY=VAL (repeatable) goes to every server (e.g. OMP_NUM_THREADS=1 to compare with the
defaults, PDSERVE_CORE_SHARE=0 for the thread pools before CoreShare); --rounds N repeats
both deployments in turn (colocated, pd, colocated, ...). The servers count each other in a
private core registry (a temp dir), not the host's.

  .venv/bin/python scripts/bench_pd_cpu.py [--num-requests 600] [--rounds 1]
      [--out bench/results/pd_cpu.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

import httpx
import psutil

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from engine.net import free_port  # noqa: E402
from pdserve.launcher import ServerProcess, launch_server  # noqa: E402
from tests.pd_harness import assert_no_leaks, role_args, start_proxy, stop_all  # noqa: E402

WORDS = ("the a of to and in is it that was for on are with as his they be at one have this "
         "from or had by word but what some we can out other were all there when up use your "
         "how said an each she which do their time if will way about many then them write "
         "would like so these her long make thing see him two has look more day could go come "
         "did number sound no most people my over know water than call first who may down side "
         "been now find any new work part take get place made live where after back little only "
         "round man year came show every good me give our under name very through just form "
         "sentence great think say help low line differ turn cause much mean before move right "
         "boy old too same tell does set three want air well also play small end put home read "
         "hand port large spell add even land here must big high such follow act why ask men "
         "change went light kind off need house picture try us again animal point mother world "
         "near build self earth father head stand own page should country found answer school "
         "grow study still learn plant cover food sun four between state keep eye never last "
         "let thought city tree cross farm hard start might story saw far sea draw left late run "
         "while press close night real life few north open seem together next white children "
         "begin got walk example ease paper group always music those both mark often letter "
         "until mile river car feet care second book carry took science eat room friend began "
         "idea fish mountain stop once base hear horse cut sure watch color face wood main").split()
ENV = {"PDSERVE_DEBUG_ROUTES": "1"}  # /engine_stats: the blocks-back check


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 80))) for _ in range(n)]


def tree(server: ServerProcess) -> list[psutil.Process]:
    return [psutil.Process(server.pid), *server.descendants()]


def cpu_snapshot(server: ServerProcess) -> dict[str, Any]:
    """{"total": CPU s of the tree (reaped children included), "threads": {(pid, tid): (name,
    CPU s)}}."""
    total, threads = 0.0, {}
    for p in tree(server):
        role = "api" if p.pid == server.pid else "core"
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
            for th in p.threads():
                try:
                    with open(f"/proc/{p.pid}/task/{th.id}/comm") as f:
                        name = f.read().strip()
                except OSError:
                    name = "?"
                if th.id == p.pid:
                    name += "(main)"
                threads[(p.pid, th.id)] = (f"{role}:{name}", th.user_time + th.system_time)
        except psutil.NoSuchProcess:
            continue
    return {"total": total, "threads": threads}


def cpu_delta(before: dict[str, Any], after: dict[str, Any], top: int) -> dict[str, Any]:
    per_name: Counter[str] = Counter()
    spenders = []
    for key, (name, secs) in after["threads"].items():
        spent = secs - before["threads"].get(key, (name, 0.0))[1]
        per_name[name] += spent
        spenders.append((spent, f"{name} tid={key[1]}"))
    spenders.sort(reverse=True)
    return {"cpu_s": round(after["total"] - before["total"], 2),
            "by_thread_name": {k: round(v, 2) for k, v in per_name.most_common(top)},
            "top_threads": [[n, round(s, 2)] for s, n in spenders[:top]]}


async def _one(client: httpx.AsyncClient, url: str, prompt: str, out_len: int) -> str:
    body = {"model": "m", "prompt": prompt, "max_tokens": out_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    text = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"error event: {chunk['error']}")
                text += [c.get("text") or "" for c in chunk.get("choices") or []]
    return "".join(text)


async def _load(url: str, texts: list[str], out_len: int) -> tuple[float, list[str]]:
    limits = httpx.Limits(max_connections=len(texts) + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await _one(client, url, "warm up the engine", 4)
        start = time.perf_counter()
        answers = await asyncio.gather(*(_one(client, url, t, out_len) for t in texts))
        return time.perf_counter() - start, list(answers)


PROFILE_DIR: str | None = None  # --profile: py-spy records every process of every server


def start_spies(kind: str, servers: dict[str, ServerProcess]) -> list[subprocess.Popen]:
    if PROFILE_DIR is None:
        return []
    spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
    spies = []
    for name, server in servers.items():
        for p in tree(server):
            role = "api" if p.pid == server.pid else "core"
            out = os.path.join(PROFILE_DIR, f"{kind}-{name}-{role}-{p.pid}.txt")
            spies.append(subprocess.Popen(
                [spy, "record", "-p", str(p.pid), "-r", "200", "-f", "raw", "--threads",
                 "--nonblocking", "-o", out], stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL))
    time.sleep(1.0)  # py-spy attaches (a bench script, not a test)
    return spies


def stop_spies(spies: list[subprocess.Popen]) -> None:
    for spy in spies:
        spy.send_signal(signal.SIGINT)
    for spy in spies:
        spy.wait(60)


def num_steps(server: ServerProcess) -> int | None:
    """The engine's busy-loop steps so far (/engine_stats), None for a proxy."""
    try:
        stats = httpx.get(f"{server.url}/engine_stats", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return None
    found = [v for k, v in _walk(stats) if k == "num_steps" and isinstance(v, int)]
    return sum(found) if found else None


def _walk(obj: Any):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield k, v
            yield from _walk(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _walk(v)


def measure(kind: str, servers: dict[str, ServerProcess], url: str, texts: list[str],
            out_len: int, top: int) -> tuple[dict[str, Any], list[str]]:
    spies = start_spies(kind, servers)
    steps0 = {name: num_steps(s) for name, s in servers.items()}
    before = {name: cpu_snapshot(s) for name, s in servers.items()}
    wall, answers = asyncio.run(_load(url, texts, out_len))
    after = {name: cpu_snapshot(s) for name, s in servers.items()}
    stop_spies(spies)
    cpu = {name: cpu_delta(before[name], after[name], top) for name in servers}
    for name, s in servers.items():
        if steps0[name] is not None and (steps := num_steps(s)) is not None:
            cpu[name]["steps"] = steps - steps0[name]
    total = sum(c["cpu_s"] for c in cpu.values())
    print(f"{kind:10s} wall {wall:6.1f} s  CPU {total:6.1f} s ("
          + ", ".join(f"{n} {c['cpu_s']:.1f}" + (f" in {c['steps']} steps" if "steps" in c
                                                   else "") for n, c in cpu.items())
          + f")  CPU/request {1e3 * total / len(texts):.1f} ms", flush=True)
    return {"wall_s": round(wall, 2), "cpu_s": round(total, 2),
            "cpu_ms_per_request": round(1e3 * total / len(texts), 2), "servers": cpu}, answers


def colocated(args: argparse.Namespace, env: dict[str, str],
              texts: list[str]) -> tuple[dict[str, Any], list[str]]:
    server = launch_server(args.model, "--num-kv-blocks", str(args.num_blocks),
                           "--max-model-len", "1024", "--served-model-name", "m",
                           "--log-level", "warning", env={**ENV, **env})
    try:
        result = measure("colocated", {"engine": server}, server.url, texts, args.output_len,
                         args.top)
        assert_no_leaks([server])
        return result
    finally:
        server.stop()


def pd(args: argparse.Namespace, extra: dict[str, str],
       texts: list[str]) -> tuple[dict[str, Any], list[str]]:
    env = {**ENV, **extra}
    procs = []
    try:
        for module, eid in (("prefill", "P0"), ("decode", "D0")):
            procs.append(launch_server(
                args.model, *role_args(args.num_blocks, None, "NixlPushConnector", eid,
                                       free_port(count=2)),
                module=module, env=env, wait=False))
        for s in procs:
            s.wait_healthy(180)
        old = os.environ.copy()
        os.environ.update(extra)  # start_proxy passes os.environ on
        try:
            proxy = start_proxy([procs[0].url], [procs[1].url], "push",
                                *(("--tokenizer", args.model) if args.proxy_tokenizer else ()))
        finally:
            os.environ.clear()
            os.environ.update(old)
        procs.append(proxy)
        result = measure("pd", dict(zip(("P", "D", "proxy"), procs, strict=True)), proxy.url,
                         texts, args.output_len, args.top)
        assert_no_leaks(procs[:2])
        return result
    finally:
        stop_all(procs)


def calibrate_first(env: dict[str, str]) -> None:
    """The kernels' calibrations for every thread count the servers will run (the colocated
    one at all cores, P and D at a share), measured now and stored where quiet, so that no
    engine measures one inside the measured load (engine/kernels/calibrate.py)."""
    cores = len(os.sched_getaffinity(0))
    for threads in sorted({1, max(1, cores // 2), cores}):
        out = subprocess.run([sys.executable, "-m", "engine.kernels"], capture_output=True,
                             text=True, cwd=ROOT, env={**os.environ, **env,
                                             "OMP_NUM_THREADS": str(threads)})
        print(f"calibration at {threads} threads: {out.stdout.strip() or out.stderr[-300:]}",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=".models/tiny-llama")
    ap.add_argument("--num-requests", type=int, default=600)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--num-blocks", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VAL")
    ap.add_argument("--baseline-env", action="append", default=[], metavar="KEY=VAL",
                    help="also run both deployments with these on top of --env, in every "
                         "round right after the defaults (e.g. PDSERVE_CORE_SHARE=0)")
    ap.add_argument("--proxy-tokenizer", action="store_true",
                    help="the proxy tokenizes once (--tokenizer MODEL): no engine encodes")
    ap.add_argument("--top", type=int, default=8, help="threads listed per server")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="result JSON")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="py-spy record (raw, 200 Hz) of every server process into DIR")
    args = ap.parse_args()
    global PROFILE_DIR
    PROFILE_DIR = args.profile
    if PROFILE_DIR:
        os.makedirs(PROFILE_DIR, exist_ok=True)
    args.env = dict(kv.split("=", 1) for kv in args.env)
    # The engines count each other in a node-local registry (engine/threads.py CoreShare):
    # a private one, so the measure is one P and one D sharing the cores, not whatever other
    # engines run on this host.
    args.env.setdefault("PDSERVE_CORE_REGISTRY", tempfile.mkdtemp(prefix="pd-cpu-cores-"))
    settings = {"default": args.env}
    if args.baseline_env:
        settings["baseline"] = {**args.env,
                                **dict(kv.split("=", 1) for kv in args.baseline_env)}
    texts = prompts(args.num_requests, args.seed)
    calibrate_first(args.env)
    runs: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for setting, env in settings.items():
            col, want = colocated(args, env, texts)
            dis, got = pd(args, env, texts)
            diff = sum(a != b for a, b in zip(want, got, strict=True))
            runs.append({"round": r, "setting": setting, "load_avg": os.getloadavg(),
                         "colocated": col, "pd": dis, "answers_differ": diff,
                         "cpu_ratio": round(dis["cpu_s"] / col["cpu_s"], 3),
                         "wall_ratio": round(dis["wall_s"] / col["wall_s"], 3)})
            print(f"round {r} {setting}: pd/colocated CPU {runs[-1]['cpu_ratio']:.2f}x  wall "
                  f"{runs[-1]['wall_ratio']:.2f}x  answers differing {diff}/{len(texts)}  "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
            if diff:
                raise SystemExit(f"{diff} P/D answers differ from the colocated ones")
    result = {"cpu": platform.processor() or _model_name(), "model_name": _model_name(),
              "cores": len(os.sched_getaffinity(0)), "load_avg": os.getloadavg(),
              "num_requests": args.num_requests, "output_len": args.output_len,
              "model": args.model, "env": args.env, "settings": settings,
              "proxy_tokenizer": args.proxy_tokenizer, "runs": runs}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


def _model_name() -> str:
    with open("/proc/cpuinfo") as f:
        return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                    "?")


if __name__ == "__main__":
    main()
