"""`pdserve bench multiturn`: routing policies side by side on a multi-turn chat workload.

Starts P0, P1, D0, D1 (push connector, every engine publishing KV events) on `--model`, and
for each topology (2P1D: D0 only; 2P2D) one proxy per policy over the same engines:

  kv-aware          --routing kv-aware, conditional disaggregation on (--disagg-min-tokens T)
  kv-aware-always   kv-aware with --disagg-min-tokens 0: every request disaggregated
  least-outstanding the proxy's choice before routing policies existed
  round-robin

Each policy gets its own conversations (same shape, its own random tokens; one shared system
prompt per topology). Rounds are interleaved: turn t of every policy's conversations, the
policies in a rotating order, before turn t+1 — so the machine's load hits every policy
alike; within a batch the conversations go in a random order. A turn is the history
(system prompt, earlier user turns and the answers D streamed back, their token ids read
from the stream's `token_ids`, vLLM's return_token_ids: exactly what D computed, so its
prefix cache can hold the answer) plus `--user-tokens` new tokens.

Prefill tokens computed per request: each policy's proxy counts the prompt tokens the engine
it chose computes (pdserve:proxy_computed_prompt_tokens_total: P's uncached part of a pair,
D's of D alone), from its index of every engine's cache, rebuilt from their KV events; read
before and after each of its batches. (The engines' vllm:prefix_cache_queries/_hits count
only a hit's own engine's tokens, so they tell the same from the engines' side.)

The sweep (`--sweep`): fresh (uncached) prompts of each length, D alone vs disaggregated,
interleaved, while `--sweep-background` long decodes run on D; the crossover (the shortest
length from which disaggregating wins the TTFT median) is the measured default of
`pdserve proxy --disagg-min-tokens`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from engine.net import free_port
from pdserve.launcher import ServerProcess, launch_server

POLICIES = {
    "kv-aware": ("--routing", "kv-aware"),
    "kv-aware-always": ("--routing", "kv-aware", "--disagg-min-tokens", "0"),
    "least-outstanding": ("--routing", "least-outstanding"),
    "round-robin": ("--routing", "round-robin"),
}
ENV = {"OMP_NUM_THREADS": "1"}
TOKEN_LO, TOKEN_HI = 10, 8000  # random prompt ids, clear of the special tokens


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=".models/bench-llama")
    parser.add_argument("--conversations", type=int, default=16, help="per policy")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--user-tokens", type=int, default=64)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4,
                        help="conversations of one policy in flight at once")
    parser.add_argument("--topologies", default="2p1d,2p2d")
    parser.add_argument("--num-kv-blocks", type=int, default=4096)
    parser.add_argument("--disagg-min-tokens", type=int, default=None,
                        help="kv-aware's threshold (default: the sweep's crossover, else 128)")
    parser.add_argument("--sweep", default="16,32,64,128,256,512",
                        help="uncached lengths of the D-alone vs disaggregated sweep ('' skips)")
    parser.add_argument("--sweep-repeats", type=int, default=3)
    parser.add_argument("--sweep-background", type=int, default=2,
                        help="long decodes kept running on D during the sweep")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json", default="bench/results/multiturn.json")
    parser.add_argument("--plot", default="bench/results/multiturn.png")


@dataclass
class Turn:
    policy: str
    conv: int
    turn: int
    prompt_len: int
    ttft: float
    ok: bool
    computed: float = 0.0  # the batch's computed prefill tokens / its requests


@dataclass
class Cluster:
    model: str
    prefills: list[ServerProcess]
    decodes: list[ServerProcess]
    events: dict[str, str] = field(default_factory=dict)  # url -> --kv-events value
    procs: list[ServerProcess] = field(default_factory=list)

    def proxy(self, decodes: list[ServerProcess], *args: str) -> ServerProcess:
        port = free_port()
        argv = [sys.executable, "-m", "proxy", "--host", "127.0.0.1", "--port", str(port),
                "--mode", "push", "--health-interval", "1", "--log-level", "warning", *args]
        for s in self.prefills:
            argv += ["--prefill", s.url]
        for s in decodes:
            argv += ["--decode", s.url]
        # every policy's proxy tokenizes and mirrors the caches (its computed-token counts),
        # whether its policy looks at them or not: the same per-request overhead for all
        argv += ["--tokenizer", self.model]
        for s in self.prefills + decodes:
            argv += ["--kv-events", self.events[s.url]]
        proxy = ServerProcess(argv, "127.0.0.1", port, {**os.environ, **ENV}, None)
        self.procs.append(proxy)
        proxy.wait_healthy(60)
        return proxy


def _launch(model: str, name: str, module: str, num_blocks: int, log_dir: str
            ) -> tuple[ServerProcess, str]:
    ev = free_port(count=2)
    cfg = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": f"tcp://*:{ev}", "replay_endpoint": f"tcp://*:{ev + 1}"})
    s = launch_server(model, "--num-kv-blocks", str(num_blocks), "--kv-connector",
                      "NixlPushConnector", "--engine-id", name, "--kv-port",
                      str(free_port(count=2)), "--max-model-len", "2048",
                      "--served-model-name", "m", "--log-level", "warning",
                      "--kv-events-config", cfg, module=module, env=ENV, wait=False,
                      log_path=os.path.join(log_dir, f"{name}.log"))
    return s, f"{s.url}=tcp://127.0.0.1:{ev},tcp://127.0.0.1:{ev + 1}"


def start_cluster(model: str, num_blocks: int, log_dir: str) -> Cluster:
    """P0, P1, D0, D1 side by side; one that fails to start (a port taken by another
    process while it loaded: the machine is shared) is started again, twice at most."""
    cluster = Cluster(model, [], [])
    roles = (("P0", "prefill"), ("P1", "prefill"), ("D0", "decode"), ("D1", "decode"))
    started = {name: _launch(model, name, module, num_blocks, log_dir)
               for name, module in roles}
    for name, module in roles:
        for attempt in range(3):
            s, events = started[name]
            try:
                s.wait_healthy(600)
                break
            except RuntimeError as exc:
                s.stop()
                if attempt == 2:
                    for other, _ in started.values():
                        other.stop()
                    raise
                print(f"{name} failed to start ({exc}); starting it again", flush=True)
                started[name] = _launch(model, name, module, num_blocks, log_dir)
        cluster.procs.append(s)
        (cluster.prefills if module == "prefill" else cluster.decodes).append(s)
        cluster.events[s.url] = events
    return cluster


def computed_tokens(proxy: ServerProcess) -> float:
    """Prompt tokens the engines computed for the requests `proxy` routed so far: its
    pdserve:proxy_computed_prompt_tokens_total (P's uncached part of a pair, D's of D alone,
    from its index of the engines' caches, which their KV events rebuild exactly)."""
    name = "pdserve:proxy_computed_prompt_tokens_total"
    return sum(float(line.rsplit(" ", 1)[1])
               for line in httpx.get(proxy.url + "/metrics", timeout=30).text.splitlines()
               if line.startswith(name + "{"))


async def stream_turn(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int,
                      vocab: dict[str, int]) -> tuple[float, list[int], bool]:
    """(TTFT, the answer's token ids, ok) of one streamed greedy completion."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "return_token_ids": True, "ignore_eos": True}
    sent, ttft, answer = time.perf_counter(), None, []
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return 0.0, [], False
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            # the ids, not the text: a text decoded from several ids maps back to one of them
            tokens = choices[0].get("token_ids") or []
            if tokens and ttft is None:
                ttft = time.perf_counter() - sent
            answer += tokens
    return (ttft or 0.0), answer, ttft is not None


async def run_batch(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int,
                    vocab: dict[str, int]) -> list[tuple[float, list[int], bool]]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(p: list[int]) -> tuple[float, list[int], bool]:
            async with sem:
                return await stream_turn(client, url, p, max_tokens, vocab)
        return await asyncio.gather(*(one(p) for p in prompts))


def run_topology(cluster: Cluster, name: str, args: argparse.Namespace, threshold: int,
                 vocab: dict[str, int], rng: random.Random) -> list[Turn]:
    decodes = cluster.decodes[:1] if name == "2p1d" else cluster.decodes
    proxies = {}
    for policy, pargs in POLICIES.items():
        if policy == "kv-aware":
            pargs = (*pargs, "--disagg-min-tokens", str(threshold))
        proxies[policy] = cluster.proxy(decodes, *pargs)
    system = [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(args.system_tokens)]
    history = {p: [list(system) for _ in range(args.conversations)] for p in POLICIES}
    turns: list[Turn] = []
    order = list(POLICIES)
    for t in range(args.turns):
        for policy in order[t % len(order):] + order[:t % len(order)]:
            convs = history[policy]
            for h in convs:
                h += [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(args.user_tokens)]
            # follow-ups arrive in no set order: a fixed one would hand least-outstanding's
            # round-robin ties the same P for a conversation every turn, by accident
            order_c = rng.sample(range(len(convs)), len(convs))
            before = computed_tokens(proxies[policy])
            shuffled = asyncio.run(run_batch(proxies[policy].url, [convs[c] for c in order_c],
                                             args.answer_tokens, args.concurrency, vocab))
            results = [shuffled[order_c.index(c)] for c in range(len(convs))]
            computed = (computed_tokens(proxies[policy]) - before) / len(convs)
            for c, (ttft, answer, ok) in enumerate(results):
                turns.append(Turn(policy, c, t, len(convs[c]), ttft, ok, computed))
                convs[c] += answer
            print(f"{name} turn {t} {policy:18s} median TTFT "
                  f"{statistics.median(r[0] for r in results):.3f}s computed/req "
                  f"{computed:.0f}", flush=True)
    for proxy in proxies.values():
        proxy.stop()
        cluster.procs.remove(proxy)
    return turns


def sweep(cluster: Cluster, lengths: list[int], args: argparse.Namespace,
          vocab: dict[str, int], rng: random.Random) -> dict[str, Any]:
    """D alone vs disaggregated TTFT per uncached length, D busy with background decodes."""
    d = cluster.decodes[:1]
    alone = cluster.proxy(d, "--routing", "kv-aware", "--disagg-min-tokens", "1000000")
    disagg = cluster.proxy(d, "--routing", "kv-aware", "--disagg-min-tokens", "0")
    rows: dict[str, Any] = {}

    async def measure() -> None:
        async with httpx.AsyncClient(timeout=600) as client:
            stop = asyncio.Event()

            async def background() -> None:
                while not stop.is_set():
                    p = [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(32)]
                    await stream_turn(client, alone.url, p, 256, vocab)
            bg = [asyncio.create_task(background()) for _ in range(args.sweep_background)]
            for n in lengths:
                got: dict[str, list[float]] = {"alone": [], "disaggregated": []}
                for _ in range(args.sweep_repeats):
                    for key, proxy in (("alone", alone), ("disaggregated", disagg)):
                        p = [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]
                        ttft, _, ok = await stream_turn(client, proxy.url, p, 2, vocab)
                        if ok:
                            got[key].append(ttft)
                rows[str(n)] = {k: statistics.median(v) if v else None for k, v in got.items()}
                print(f"sweep {n:5d} tokens: {rows[str(n)]}", flush=True)
            stop.set()
            await asyncio.gather(*bg)
    asyncio.run(measure())
    for proxy in (alone, disagg):
        proxy.stop()
        cluster.procs.remove(proxy)
    crossover = None  # the shortest length from which disaggregating wins at every length
    for n in sorted(map(int, rows), reverse=True):
        r = rows[str(n)]
        if not (r["alone"] and r["disaggregated"] and r["disaggregated"] < r["alone"]):
            break
        crossover = n
    return {"ttft_median_s": rows, "crossover_tokens": crossover,
            "background_decodes": args.sweep_background, "repeats": args.sweep_repeats}


def summarize(turns: list[Turn]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for policy in POLICIES:
        mine = [t for t in turns if t.policy == policy and t.ok]
        follow = [t for t in mine if t.turn > 0]
        out[policy] = {
            "requests": len(mine),
            "failed": sum(1 for t in turns if t.policy == policy and not t.ok),
            "ttft_median_s": statistics.median(t.ttft for t in mine) if mine else None,
            "followup_ttft_median_s": (statistics.median(t.ttft for t in follow)
                                       if follow else None),
            "computed_prefill_tokens_per_request": (statistics.mean(t.computed for t in mine)
                                                    if mine else None),
            "followup_computed_per_request": (statistics.mean(t.computed for t in follow)
                                              if follow else None),
            "prompt_tokens_per_request": (statistics.mean(t.prompt_len for t in mine)
                                          if mine else None),
        }
    lo, kv, always = (out[p]["ttft_median_s"] for p in
                      ("least-outstanding", "kv-aware", "kv-aware-always"))
    f_kv, f_always = (out[p]["followup_ttft_median_s"] for p in ("kv-aware", "kv-aware-always"))
    out["ratios"] = {
        "kv_aware_over_least_outstanding": kv / lo if kv and lo else None,
        "kv_aware_always_over_least_outstanding": always / lo if always and lo else None,
        "followup_conditional_over_always": f_kv / f_always if f_kv and f_always else None,
    }
    return out


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tops = list(result["topologies"])
    fig, axes = plt.subplots(1, len(tops) + 1, figsize=(5 * (len(tops) + 1), 4))
    for ax, top in zip(axes, tops, strict=False):
        s = result["topologies"][top]["summary"]
        names = list(POLICIES)
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], [s[n]["ttft_median_s"] or 0 for n in names], 0.4,
               label="all turns")
        ax.bar([i + 0.2 for i in x], [s[n]["followup_ttft_median_s"] or 0 for n in names],
               0.4, label="follow-up turns")
        ax.set_xticks(list(x), names, rotation=20, fontsize=8)
        ax.set_ylabel("median TTFT (s)")
        ax.set_title(top)
        ax.legend(fontsize=8)
    ax = axes[-1]
    rows = result.get("sweep", {}).get("ttft_median_s", {})
    if rows:
        ns = [int(n) for n in rows]
        for key in ("alone", "disaggregated"):
            ax.plot(ns, [rows[str(n)][key] or float("nan") for n in ns], marker="o", label=key)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("uncached prompt tokens")
        ax.set_ylabel("median TTFT (s)")
        ax.set_title("D alone vs disaggregated (D decoding)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def machine() -> dict[str, str]:
    def sh(cmd: str) -> str:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()
    return {"cpu": sh("lscpu | grep 'Model name' | sed 's/.*: *//'"), "cores": sh("nproc"),
            "uptime": sh("uptime")}


def main(args: argparse.Namespace) -> int:
    import tempfile

    from engine.models.formats import load_tokenizer

    tok = load_tokenizer(args.model)
    vocab: dict[str, int] = {}
    for i in reversed(range(tok.vocab_size if hasattr(tok, "vocab_size") else 8192)):
        vocab[tok.decode([i])] = i  # ambiguous strings keep the lowest id
    rng = random.Random(args.seed)
    result: dict[str, Any] = {"args": {k: v for k, v in vars(args).items()
                                       if not k.startswith("_")}, "machine_start": machine()}
    cluster = start_cluster(args.model, args.num_kv_blocks, tempfile.mkdtemp(prefix="mt-"))
    try:
        lengths = [int(x) for x in args.sweep.split(",") if x]
        if lengths:
            result["sweep"] = sweep(cluster, lengths, args, vocab, rng)
        threshold = args.disagg_min_tokens
        if threshold is None:
            threshold = (result.get("sweep") or {}).get("crossover_tokens") or 128
        result["disagg_min_tokens"] = threshold
        result["topologies"] = {}
        for top in args.topologies.split(","):
            turns = run_topology(cluster, top, args, threshold, vocab, rng)
            result["topologies"][top] = {"summary": summarize(turns),
                                         "turns": [t.__dict__ for t in turns]}
            print(json.dumps({top: result["topologies"][top]["summary"]}, indent=1), flush=True)
    finally:
        for s in reversed(cluster.procs):
            s.stop()
    result["machine_end"] = machine()
    os.makedirs(os.path.dirname(args.result_json) or ".", exist_ok=True)
    with open(args.result_json, "w") as f:
        json.dump(result, f, indent=1, default=str)
    if args.plot:
        plot(result, args.plot)
    return 0
