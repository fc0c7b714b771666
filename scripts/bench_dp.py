"""Data parallel on one host, in one run, side by side (`pdserve bench serve` against each):

  single   one `pdserve serve` engine using both cores (OMP_NUM_THREADS=2)
  single1  the same engine with one thread (what each DP rank gets)
  dp2      one `pdserve serve --data-parallel-size 2` (two engines, one thread each)
  two      two `pdserve serve` servers (one thread each), requests round-robin over both by
           the load generator (a stateless balancer; no proxy hop: the P/D proxy does not
           balance colocated servers)
and the balancing policy on a skewed workload (half long, half short requests, Poisson):
  dp2-score  vs  dp2-rr  (PDSERVE_DP_LB=round_robin): p99 TTFT ratio.

    python scripts/bench_dp.py --model DIR [--out bench/results] [--scale 1]

Writes OUT/dp_bench.md and the raw JSON/logs under OUT/dp_raw/. Every system starts fresh and
gets the same seeded workload.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from contextlib import ExitStack

from pdserve.launcher import launch_server

UNIFORM = ["--random-input-len", "256", "--random-output-len", "64", "--max-concurrency", "8"]
SKEWED = ["--random-mix", "0.5:768:96,0.5:32:8", "--request-rate", "{rate}"]


def _serve(model: str, raw: str, name: str, threads: int, stack: ExitStack, *args: str,
           env: dict[str, str] | None = None) -> str:
    server = launch_server(model, "--num-kv-blocks", "1024", "--max-model-len", "1024", *args,
                           env={"OMP_NUM_THREADS": str(threads), **(env or {})},
                           log_path=os.path.join(raw, f"{name}.log"), ready_timeout=300)
    stack.callback(server.stop)
    return server.url


def _bench(model: str, urls: list[str], raw: str, name: str, workload: list[str],
           n: int) -> dict:
    out = os.path.join(raw, f"{name}.json")
    argv = [sys.executable, "-m", "pdserve.cli", "bench", "serve", "--model", "bench",
            "--tokenizer", model, "--num-prompts", str(n), "--ignore-eos", "--seed", "7",
            "--result-json", out, "--label", name, "--disable-tqdm", *workload]
    for url in urls:
        argv += ["--base-url", url]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def _system(model: str, raw: str, name: str, workload: list[str], n: int) -> dict:
    with ExitStack() as stack:
        common = ["--served-model-name", "bench"]
        if name.startswith("single"):
            urls = [_serve(model, raw, name, 1 if name == "single1" else 2, stack, *common)]
        elif name == "two":
            urls = [_serve(model, raw, f"{name}{i}", 1, stack, *common) for i in range(2)]
        else:
            policy = "round_robin" if name.endswith("rr") else "score"
            urls = [_serve(model, raw, name, 1, stack, *common, "-dp", "2",
                           env={"PDSERVE_DP_LB": policy})]
        return _bench(model, urls, raw, name, workload, n)


def _cpu() -> str:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                  if line.startswith("model name")), platform.processor())
    flags = sorted({f for line in open("/proc/cpuinfo") if line.startswith("flags")
                    for f in line.split() if f.startswith("avx")})
    return f"{model}, {os.cpu_count()} cores visible ({' '.join(flags)})"


def _rounds(model: str, raw: str, names: tuple[str, ...], workload: list[str], n: int,
            rounds: int) -> list[dict[str, dict]]:
    """Every system once per round, rounds one after another (ABCABC): a drift of the shared
    machine hits every system, and the per-round ratios show the noise."""
    out = []
    for i in range(rounds):
        sub = os.path.join(raw, f"r{i}")
        os.makedirs(sub, exist_ok=True)
        out.append({name: _system(model, sub, name, workload, n) for name in names})
    return out


def _table(rounds: list[dict[str, dict]], base: str, key: str, title: str) -> list[str]:
    names = list(rounds[0])
    lines = [title, "", "| system | " + " | ".join(f"{key} r{i}" for i in range(len(rounds)))
             + " | " + " | ".join(f"vs {base} r{i}" for i in range(len(rounds))) + " |",
             "|---" * (1 + 2 * len(rounds)) + "|"]
    for name in names:
        vals = [r[name][key] for r in rounds]
        ratios = [r[name][key] / r[base][key] for r in rounds]
        lines.append(f"| {name} | " + " | ".join(f"{v:.1f}" for v in vals) + " | "
                     + " | ".join(f"{x:.2f}" for x in ratios) + " |")
    return [*lines, ""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--scale", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skew-rate", type=float, default=0.8,
                        help="requests/s of the skewed load (~80%% of DP=2's capacity here)")
    args = parser.parse_args()
    raw = os.path.join(args.out, "dp_raw")
    os.makedirs(raw, exist_ok=True)
    n = max(8, int(48 * args.scale))
    skewed = [a.format(rate=args.skew_rate) for a in SKEWED]
    uniform = _rounds(args.model, raw, ("single", "single1", "dp2", "two"), UNIFORM, n,
                      args.rounds)
    skew = _rounds(args.model, raw, ("dp2-score", "dp2-rr"), skewed, n, args.rounds + 1)
    lines = [f"# Data parallel on one host ({_cpu()})", "",
             f"Machine load average at the end: {os.getloadavg()[0]:.1f} (shared).", ""]
    lines += _table(uniform, "single", "output_throughput",
                    f"Uniform: {n} requests, 256 in / 64 out, max concurrency 8; output "
                    "tokens/s, and the ratio to `single` in the same round.")
    lines += _table(uniform, "single", "median_ttft_ms", "Median TTFT (ms), same runs.")
    lines += _table(skew, "dp2-score", "p99_ttft_ms",
                    f"Skewed: {n} requests, half 768 in / 96 out, half 32 in / 8 out, Poisson "
                    f"{args.skew_rate}/s, DP=2; p99 TTFT (ms) and round-robin / score.")
    lines += _table(skew, "dp2-score", "median_ttft_ms", "Median TTFT (ms), same runs.")
    with open(os.path.join(args.out, "dp_bench.md"), "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(raw, "summary.json"), "w") as f:
        json.dump({"uniform": uniform, "skewed": skew}, f, indent=1)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
