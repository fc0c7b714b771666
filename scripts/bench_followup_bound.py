"""Why a short follow-up on D alone is not faster than disaggregating it, and the bounds of
issue 29's targets (bench/results/multiturn_followup_bound.json).

P0 + D0 (push, bench model, KV events), two kv-aware proxies over them (`disagg`:
--disagg-min-tokens 0, `alone`: every request on D alone) and P and D served directly
(`P-direct`, `D-direct`: colocated on one engine). Each path gets its own conversations (one
shared 512-token system prompt, 64-token user turns, 16-token greedy answers whose token ids
come back with return_token_ids), interleaved request by request in a random order per
round. Reported per path: follow-up TTFT medians, and usage's cached_tokens (D alone must hit
the history: what P pushed and what D decoded). Then P's TTFT for fresh tails of 16 / 80 /
240 tokens after the cached system prompt: the per-token prefill cost and the fixed part.

    .venv/bin/python scripts/bench_followup_bound.py --conversations 5 --turns 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import tempfile
import time

import httpx

from pdserve.bench import multiturn as mt


def ask(url: str, prompt: list[int], n: int = 16) -> tuple[float, list[int], int]:
    """(TTFT, answer ids, usage's cached_tokens or -1) of one streamed greedy completion."""
    ids, usage, ttft, t0 = [], None, None, time.perf_counter()
    body = {"model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            j = json.loads(line[6:])
            usage = j.get("usage") or usage
            for ch in j.get("choices") or []:
                if ch.get("token_ids"):
                    ttft = ttft or time.perf_counter() - t0
                    ids += ch["token_ids"]
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", -1)
    return ttft or 0.0, ids, cached


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=".models/bench-llama")
    ap.add_argument("--conversations", type=int, default=5)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--out", default="bench/results/multiturn_followup_bound.json")
    args = ap.parse_args()
    log = tempfile.mkdtemp(prefix="followup-")
    p, pev = mt._launch(args.model, "P0", "prefill", 4096, log)
    d, dev = mt._launch(args.model, "D0", "decode", 4096, log)
    p.wait_healthy(900)
    d.wait_healthy(900)
    c = mt.Cluster(args.model, [p], [d], {p.url: pev, d.url: dev}, [p, d])
    out: dict = {"machine_start": mt.machine()}
    try:
        dis = c.proxy([d], "--routing", "kv-aware", "--disagg-min-tokens", "0")
        alone = c.proxy([d], "--routing", "kv-aware", "--disagg-min-tokens", "1000000")
        paths = {"disagg": dis.url, "alone": alone.url, "P-direct": p.url, "D-direct": d.url}
        rng = random.Random(2)
        system = [rng.randrange(10, 8000) for _ in range(512)]
        hist = {(k, i): list(system) for k in paths for i in range(args.conversations)}
        ttft = {k: {t: [] for t in range(args.turns)} for k in paths}
        cached = {k: {t: [] for t in range(args.turns)} for k in paths}
        for t in range(args.turns):
            for i in range(args.conversations):
                order = list(paths)
                rng.shuffle(order)
                for k in order:
                    h = hist[(k, i)]
                    h += [rng.randrange(10, 8000) for _ in range(64)]
                    x, ids, hit = ask(paths[k], h)
                    h += ids
                    ttft[k][t].append(x)
                    cached[k][t].append(hit)
            print("turn", t, {k: round(statistics.median(ttft[k][t]), 4) for k in paths},
                  {k: statistics.median(cached[k][t]) for k in paths}, flush=True)
        tail = {}
        for n in (16, 80, 240):
            tail[n] = statistics.median(
                ask(p.url, system + [rng.randrange(10, 8000) for _ in range(n)], 1)[0]
                for _ in range(4))
        follow = {k: statistics.median(x for t in range(1, args.turns) for x in ttft[k][t])
                  for k in paths}
        out.update(ttft=ttft, cached_tokens=cached, followup_ttft_median_s=follow,
                   p_ttft_by_uncached_tail_s=tail,
                   alone_over_disagg=follow["alone"] / follow["disagg"])
        print(json.dumps({k: v for k, v in out.items() if k not in ("ttft", "cached_tokens")},
                         indent=1), flush=True)
    finally:
        for s in reversed(c.procs):
            s.stop()
    out["machine_end"] = mt.machine()
    out["uptime_end"] = subprocess.run("uptime", capture_output=True, text=True).stdout
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
