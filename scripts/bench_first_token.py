"""Zero-bubble handover benchmark (issue 28): TTFT through the push proxy vs P alone.

One 1P1D push deployment of the bench model (P pinned to core 0, D to core 1 with --pin;
otherwise both unpinned, sharing the cores). For each prompt length, rounds of three
requests sent one at a time, in turn, each with a fresh random prompt (no prefix-cache hit):
  colocated  streamed straight to P as a plain request (P's own TTFT)
  seeded     through the proxy: D starts from P's first token (this issue)
  recompute  through the proxy with kv_transfer_params {"first_token": false}: today's
             handover, D computes the last prompt position again
  baseline   (with --baseline-tree) seeded, through the same proxy run from another checkout
             on the same engines: a proxy change before/after in one run
TTFT is the arrival of the first chunk that carries text; the gap is the next such chunk.
The client keeps its connections open (one httpx.Client, as the openai client does): a new
client per request costs ~40 ms of SSL-context and connection set-up before the request is
even sent, whose spread (+-10 ms under load) swamped the 2 ms being measured.
Reported: medians, the paired median of (proxy - colocated) per round, the CPU model and
the load average; and, since P's own prefill swings by +-10 % between requests on a noisy
machine, each request's time outside P (its TTFT minus P's server-side TTFT for it, read from
P's metrics between requests) and the proxy modes' median of it minus the colocated one's.
The plain difference of medians (the issue's statistic) gets a 95 % bootstrap interval.
Writes bench/results/first_token.json (or --out).

  .venv/bin/python scripts/bench_first_token.py [--pin] [--rounds 15] [--lengths 128 1024]
      [--baseline-tree DIR] [--modes seeded ...] [--pin-proxy CORE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import httpx
import psutil

from engine.net import free_port
from pdserve.bench.machine import cpu_info
from pdserve.launcher import ServerProcess, launch_server

MODES = ("colocated", "seeded", "recompute", "baseline")
_FROM_TREE = """import sys
sys.path.insert(0, {tree!r})
from proxy.cli import run
sys.exit(run(sys.argv[1:]))
"""


def _role(module: str, model: str, engine_id: str, env: dict[str, str]) -> ServerProcess:
    args = ["--num-kv-blocks", "1024", "--kv-connector", "NixlPushConnector", "--engine-id",
            engine_id, "--kv-port", str(free_port(count=2)), "--max-model-len", "4096",
            "--served-model-name", "m", "--log-level", "warning"]
    return launch_server(model, *args, module=module, env=env, wait=False)


def _pin(server: ServerProcess, core: int | None) -> None:
    """Every thread of the server's processes on `core`: psutil's cpu_affinity pins a
    process's main thread only, which left P's transfer thread (its WRITE's copy), output
    thread and API-server threads free to run on D's core."""
    if core is None:
        return
    for p in [psutil.Process(server.pid), *psutil.Process(server.pid).children(recursive=True)]:
        for thread in p.threads():
            try:
                os.sched_setaffinity(thread.id, {core})
            except (ProcessLookupError, PermissionError):
                pass  # a thread that ended meanwhile


def _stream(client: httpx.Client, url: str, body: dict) -> tuple[float, float | None]:
    """(TTFT, gap to the next text chunk) of one streamed completion, seconds."""
    t0 = time.perf_counter()
    first = second = None
    with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                       timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if not any(c.get("text") for c in choices):
                continue
            now = time.perf_counter()
            if first is None:
                first = now
            elif second is None:
                second = now
    assert first is not None, "no token"
    return first - t0, None if second is None else second - first


def p_ttft_sum(client: httpx.Client, url: str) -> float:
    """P's own TTFT so far (pdserve:time_to_first_token_seconds_sum: arrival at P's API server
    to its first token), read between requests: its growth is one request's P-side TTFT."""
    for ln in client.get(f"{url}/metrics", timeout=30).text.splitlines():
        if ln.startswith("pdserve:time_to_first_token_seconds_sum"):
            return float(ln.rsplit(" ", 1)[1])
    raise RuntimeError(f"{url}/metrics has no pdserve:time_to_first_token_seconds_sum")


def proxy_hop_ms(url: str) -> dict[str, float]:
    """The proxy's own share of the first bytes (pdserve:proxy_hop_seconds): mean ms per part."""
    sums: dict[str, float] = {}
    for ln in httpx.get(f"{url}/metrics").text.splitlines():
        if ln.startswith("pdserve:proxy_hop_seconds_sum") or ln.startswith(
                "pdserve:proxy_hop_seconds_count"):
            key = ln.split("{", 1)[0].rsplit("_", 1)[1] + ln.split('part="', 1)[1].split('"')[0]
            sums[key] = float(ln.rsplit(" ", 1)[1])
    return {part: round(sums[f"sum{part}"] / sums[f"count{part}"] * 1e3, 3)
            for part in ("dispatch", "relay") if sums.get(f"count{part}")}


def _median_diff_ci(mode: list, colocated: list, draws: int = 2000) -> list[float]:
    """95 % bootstrap interval (ms) of median(mode's TTFTs) - median(colocated's)."""
    rng = random.Random(0)
    x, y = [t for t, _ in mode], [t for t, _ in colocated]
    diffs = sorted(statistics.median(rng.choices(x, k=len(x)))
                   - statistics.median(rng.choices(y, k=len(y))) for _ in range(draws))
    return [round(diffs[int(0.025 * draws)] * 1e3, 2), round(diffs[int(0.975 * draws)] * 1e3, 2)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=".models/bench-llama")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--pin", action="store_true", help="P on core 0, D on core 1")
    ap.add_argument("--out", default="bench/results/first_token.json")
    ap.add_argument("--baseline-tree", help="also the proxy of this checkout (mode baseline)")
    ap.add_argument("--pin-proxy", type=int, help="the proxies on this core (default: free)")
    ap.add_argument("--modes", nargs="+", choices=MODES[1:],
                    help="proxy modes beside colocated (default: seeded, recompute, and "
                         "baseline with --baseline-tree): fewer modes, more rounds an hour")
    a = ap.parse_args()
    modes = MODES if a.baseline_tree else MODES[:3]
    if a.modes:
        modes = ("colocated", *(m for m in MODES[1:] if m in a.modes))
    env = {"OMP_NUM_THREADS": "1"}
    p = _role("prefill", a.model, "P0", env)
    d = _role("decode", a.model, "D0", env)
    procs = [p, d]
    client = httpx.Client()  # keep-alive to P and to the proxy, like a real client's pool
    try:
        for s in procs:
            s.wait_healthy(300)
        _pin(p, 0 if a.pin else None)
        _pin(d, 1 if a.pin else None)
        def start_proxy(run: list[str]) -> ServerProcess:
            port = free_port()
            proxy = ServerProcess([sys.executable, *run, "--host", "127.0.0.1", "--port",
                                   str(port), "--mode", "push", "--prefill", p.url, "--decode",
                                   d.url, "--log-level", "warning",
                                   # a pinned engine on a loaded host answers health checks
                                   # late: it must not leave rotation (a 503) mid-round
                                   "--health-timeout", "30"], "127.0.0.1", port,
                                  {**os.environ, **env}, None)
            procs.append(proxy)
            proxy.wait_healthy(60)
            _pin(proxy, a.pin_proxy)
            return proxy

        proxy = start_proxy(["-m", "proxy"])
        base = proxy if not a.baseline_tree else start_proxy(
            ["-c", _FROM_TREE.format(tree=os.path.abspath(a.baseline_tree))])
        rng = random.Random(28)
        load_start = os.getloadavg()
        results: dict = {}
        for n in a.lengths:
            rows: dict[str, list] = {m: [] for m in modes}
            outside: dict[str, list[float]] = {m: [] for m in modes}  # TTFT minus P's own
            for i in range(a.rounds + 1):  # round 0 warms every path up
                for mode in modes:
                    body = {"model": "m", "prompt": [rng.randrange(4, 8000) for _ in range(n)],
                            "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
                    if mode == "recompute":
                        body["kv_transfer_params"] = {"first_token": False}
                    url = {"colocated": p.url, "baseline": base.url}.get(mode, proxy.url)
                    before = p_ttft_sum(client, p.url)
                    ttft, gap = _stream(client, url, body)
                    if i:
                        rows[mode].append((ttft, gap))
                        outside[mode].append(ttft - (p_ttft_sum(client, p.url) - before))
            med = {m: statistics.median(t for t, _ in rows[m]) for m in modes}
            gaps = {m: statistics.median(g for _, g in rows[m] if g is not None) for m in modes}
            paired = {m: statistics.median(rows[m][k][0] - rows["colocated"][k][0]
                                           for k in range(a.rounds)) for m in modes[1:]}
            results[str(n)] = {
                "median_ttft_ms": {m: round(v * 1e3, 2) for m, v in med.items()},
                "paired_minus_colocated_ms": {m: round(v * 1e3, 2) for m, v in paired.items()},
                "ttft_ratio_to_colocated": {m: round(med[m] / med["colocated"], 4)
                                            for m in modes[1:]},
                "token1_to_token2_ms": {m: round(v * 1e3, 2) for m, v in gaps.items()},
                "ttft_ms_by_round": {m: [round(t * 1e3, 2) for t, _ in rows[m]] for m in modes},
                # P's prefill swings +-10 % between requests here (808-1214 ms at 1024
                # tokens): a request's TTFT minus P's own TTFT for it (P's metrics, read
                # between requests) is the time spent outside P, without that swing
                "outside_p_median_ms": {m: round(statistics.median(outside[m]) * 1e3, 2)
                                        for m in modes},
                # P's own TTFT (its metrics) for the same requests: what P's side adds
                "p_ttft_median_ms": {m: round(statistics.median(
                    t - o for (t, _), o in zip(rows[m], outside[m], strict=True)) * 1e3, 2)
                    for m in modes},
                # the issue's own statistic with its spread: a 95 % bootstrap interval of
                # (median through the proxy - median straight to P)
                "median_diff_ci95_ms": {m: _median_diff_ci(rows[m], rows["colocated"])
                                        for m in modes[1:]},
                "outside_p_minus_colocated_ms": {
                    m: round((statistics.median(outside[m])
                              - statistics.median(outside["colocated"])) * 1e3, 2)
                    for m in modes[1:]},
            }
            print(n, json.dumps(results[str(n)]), flush=True)
        seeded = sum(float(ln.rsplit(" ", 1)[1]) for ln in
                     httpx.get(f"{d.url}/metrics").text.splitlines()
                     if ln.startswith("pdserve:kv_first_token_seeded_total"))
        out = {"model": a.model, "pinned": a.pin, "rounds": a.rounds,
               "cpu": cpu_info()["model_name"],
               "loadavg_at_start": load_start, "loadavg_at_end": os.getloadavg(),
               "d_seeded_total": seeded, "proxy_hop": proxy_hop_ms(proxy.url),
               "baseline_tree": a.baseline_tree,
               "baseline_hop": proxy_hop_ms(base.url) if a.baseline_tree else None,
               "results": results}
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
        print(json.dumps(out, indent=1))
    finally:
        client.close()
        for s in reversed(procs):
            s.stop()


if __name__ == "__main__":
    main()
