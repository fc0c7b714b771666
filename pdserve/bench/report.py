"""`python -m pdserve.bench.report`: the markdown report and plot of `scripts/bench_pd.sh`.

Reads the raw directory the script fills —
  `<system>__A_r<rate>.json`, `<system>__mix.json` (bench serve, --save-detailed),
  `overhead_<round>.json`, `<system>__cost.json`, `transfer.json` (bench transfer), `loadavg.txt` —
and writes one markdown file (machine, method, goals, tables) and one PNG (TTFT/ITL CDFs).
A missing input leaves its row or goal marked "not measured"; it never fails the report.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import statistics
from datetime import datetime, timezone
from typing import Any

SYSTEMS = ("colocated", "pull", "push")
GOAL_PUSH_TTFT = 0.8  # push median TTFT <= 0.8 x pull, same load
GOAL_ITL = 0.5  # P/D p99 ITL <= 0.5 x colocated, mixed workload
GOAL_TRANSFER = 0.8  # >= 80% of single-thread memcpy bandwidth
GOAL_PROXY_MS = 2.0  # proxy adds <= 2 ms median TTFT


def _load(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def load_runs(raw: str) -> dict[str, Any]:
    """{'A': {system: {rate: result}}, 'mix': {system: result}, 'overhead': [results],
    'cost': {system: result}, 'transfer': result|None, 'loadavg': [(phase, '1m 5m 15m')]}"""
    runs: dict[str, Any] = {"A": {}, "mix": {}, "overhead": [], "cost": {},
                            "modes_paired": None, "tp_paired": None, "hetero_paired": None}
    for path in sorted(glob.glob(os.path.join(raw, "*.json"))):
        name = os.path.basename(path)[:-5]
        data = _load(path)
        if data is None:
            continue
        if m := re.fullmatch(r"(\w+)__A_r([\d.]+)", name):
            runs["A"].setdefault(m.group(1), {})[float(m.group(2))] = data
        elif m := re.fullmatch(r"(\w+)__mix", name):
            runs["mix"][m.group(1)] = data
        elif re.fullmatch(r"overhead_\d+", name):
            runs["overhead"].append(data)
        elif name in ("modes_paired", "tp_paired", "hetero_paired"):
            runs[name] = data
        elif m := re.fullmatch(r"(\w+)__cost", name):
            runs["cost"][m.group(1)] = data
    runs["transfer"] = _load(os.path.join(raw, "transfer.json"))
    runs["loadavg"] = []
    try:
        with open(os.path.join(raw, "loadavg.txt")) as f:
            runs["loadavg"] = [tuple(line.split(" ", 1)) for line in f if line.strip()]
    except OSError:
        pass
    return runs


# ---- machine ------------------------------------------------------------------------------


def machine_info() -> dict[str, str]:
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"nproc": str(len(os.sched_getaffinity(0))), "cpu": model,
            "kernel": platform.release(), "python": platform.python_version()}


def model_info(model_dir: str | None) -> str:
    if model_dir and not os.path.isdir(model_dir):
        return _gguf_model_info(model_dir)
    cfg = _load(os.path.join(model_dir, "config.json")) if model_dir else None
    if not cfg:
        return "unknown"
    return (f"`{model_dir}`: {cfg.get('model_type')}, hidden {cfg.get('hidden_size')}, "
            f"{cfg.get('num_hidden_layers')} layers, {cfg.get('num_attention_heads')} heads "
            f"({cfg.get('num_key_value_heads')} KV), vocab {cfg.get('vocab_size')}, "
            f"{cfg.get('torch_dtype')}")


def _gguf_model_info(model: str) -> str:
    from engine.models import load_arch
    from engine.models.source import resolve_model

    try:
        a = load_arch(resolve_model(model))
    except ValueError:
        return "unknown"
    return (f"`{model}` (GGUF, dequantized): llama, hidden {a.hidden_size}, {a.num_layers} "
            f"layers, {a.num_heads} heads ({a.num_kv_heads} KV), vocab {a.vocab_size}, "
            f"tied embeddings {a.tie_word_embeddings}")


# ---- tables -------------------------------------------------------------------------------


def _ms(v: float | None) -> str:
    return "—" if v is None else (f"{v:.0f}" if v >= 100 else f"{v:.1f}")


def _row(system: str, workload: str, rate: Any, r: dict[str, Any]) -> str:
    good = r.get("request_goodput")
    return (f"| {system} | {workload} | {rate} | {r['completed']}/{r['failed']} | "
            f"{_ms(r['median_ttft_ms'])} | {_ms(r['p99_ttft_ms'])} | "
            f"{_ms(r['median_itl_ms'])} | {_ms(r['p99_itl_ms'])} | {_ms(r.get('p99_9_itl_ms'))} | "
            f"{_ms(r['median_tpot_ms'])} | {'—' if good is None else f'{good:.2f}'} | "
            f"{r['request_throughput']:.2f} | {r['output_throughput']:.1f} |")


def serving_table(runs: dict[str, Any]) -> list[str]:
    lines = ["| system | workload | rate (req/s) | done/failed | TTFT p50 | TTFT p99 | "
             "ITL p50 | ITL p99 | ITL p99.9 | TPOT p50 | goodput (req/s) | req/s | out tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rates = sorted({rate for per in runs["A"].values() for rate in per})
    for rate in rates:
        for system in SYSTEMS:
            r = runs["A"].get(system, {}).get(rate)
            if r:
                lines.append(_row(system, "A: 1024 in / 64 out", rate, r))
    for system in SYSTEMS:
        r = runs["mix"].get(system)
        if not r:
            continue
        lines.append(_row(system, "mix: all", r["request_rate"], r))
        for kind, sub in sorted(r.get("by_kind", {}).items()):
            lines.append(_row(system, f"mix: only {kind}", r["request_rate"], sub))
    return lines


# ---- goals --------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def goals(runs: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """Markdown rows of the goal table, and the numbers behind them."""
    rows = ["| goal | measured | reached |", "|---|---|---|"]
    numbers: dict[str, Any] = {}

    def verdict(ok: bool | None) -> str:
        return "not measured" if ok is None else ("**yes**" if ok else "no")

    push, pull = runs["A"].get("push", {}), runs["A"].get("pull", {})
    per_rate = {rate: _ratio(push[rate]["median_ttft_ms"], pull[rate]["median_ttft_ms"])
                for rate in sorted(set(push) & set(pull))}
    numbers["push_over_pull_ttft"] = per_rate
    measured = ", ".join(f"{rate:g}/s: {v:.2f}" for rate, v in per_rate.items()
                         if v is not None) or "—"
    hits = [v <= GOAL_PUSH_TTFT for v in per_rate.values() if v is not None]
    rows.append(f"| push median TTFT ≤ {GOAL_PUSH_TTFT} × pull, same load (workload A) | "
                f"push/pull = {measured} | {verdict(all(hits) if hits else None)}"
                f"{f' ({sum(hits)} of {len(hits)} rates)' if hits else ''} |")

    ratio, shown = side_by_side(runs["modes_paired"], "push − pull")
    numbers["push_over_pull_ttft_side_by_side"] = ratio
    rows.append(f"| push median TTFT ≤ {GOAL_PUSH_TTFT} × pull, light load, both deployments up "
                f"at once, requests alternating | {shown} | "
                f"{verdict(None if ratio is None else ratio <= GOAL_PUSH_TTFT)} |")
    ratio, shown = side_by_side(runs["tp_paired"], "TP=2 − TP=1")
    numbers["push_tp2_over_tp1_ttft_side_by_side"] = ratio
    rows.append(f"| (no goal) push with P and D at TP=2 vs TP=1, median TTFT, 1024 in, both up at "
                f"once, requests alternating | {shown} | — |")
    ratio, shown = side_by_side(runs["hetero_paired"], "P TP=2 → D TP=1 − TP=1")
    numbers["push_p2d1_over_tp1_ttft_side_by_side"] = ratio
    rows.append(f"| (no goal) push with P at TP=2, D at TP=1 vs both TP=1, median TTFT, 1024 in, "
                f"both up at once, requests alternating | {shown} | — |")

    colo = runs["mix"].get("colocated")
    for system in ("push", "pull"):
        pd = runs["mix"].get(system)
        ratio = _ratio(pd and pd["p99_itl_ms"], colo and colo["p99_itl_ms"])
        numbers[f"{system}_over_colocated_p99_itl"] = ratio
        shown = "—" if ratio is None else (
            f"{pd['p99_itl_ms']:.0f} / {colo['p99_itl_ms']:.0f} ms = {ratio:.2f}")
        rows.append(f"| {system} p99 ITL ≤ {GOAL_ITL} × colocated (mixed workload) | {shown} | "
                    f"{verdict(None if ratio is None else ratio <= GOAL_ITL)} |")

    t = runs["transfer"]
    ratio = t.get("ratio") if t else None
    numbers["transfer_ratio"] = ratio
    shown = "—" if ratio is None else (
        f"{t['gbps']:.2f} / {t['memcpy_gbps']:.2f} GB/s = {ratio:.2f}")
    rows.append(f"| transfer ≥ {GOAL_TRANSFER:.0%} of single-thread memcpy (2048 tokens) | "
                f"{shown} | {verdict(None if ratio is None else ratio >= GOAL_TRANSFER)} |")

    direct, proxied, pairs = paired_samples(runs["overhead"])
    overhead = statistics.median(pairs) if pairs else None
    numbers["proxy_overhead_ms"] = overhead
    numbers["disaggregation_added_ms"] = {s: c["added_ms"] for s, c in cost_numbers(runs).items()}
    shown = "—" if overhead is None else (
        f"median of {len(pairs)} paired differences: {overhead:+.1f} ms "
        f"(medians {statistics.median(proxied):.1f} vs {statistics.median(direct):.1f})")
    rows.append(f"| proxy adds ≤ {GOAL_PROXY_MS:g} ms median TTFT | {shown} | "
                f"{verdict(None if overhead is None else overhead <= GOAL_PROXY_MS)} |")
    return rows, numbers


def transfer_section(t: dict[str, Any] | None) -> list[str]:
    if not t:
        return ["not measured (see pd_raw/logs/transfer.txt)"]
    keys = ("bytes", "descriptors", "num_blocks", "gbps", "memcpy_gbps", "ratio",
            "memcpy_back_to_back_gbps", "e2e_gbps",
            "write_ms_median", "write_ms_p99", "e2e_ms_median", "ucx_tls", "verified")
    return ["| " + " | ".join(k for k in keys if k in t) + " |",
            "|" + "---|" * sum(1 for k in keys if k in t),
            "| " + " | ".join(str(t[k]) for k in keys if k in t) + " |"]


def paired_samples(results: list[dict[str, Any]], baseline: str | None = None
                   ) -> tuple[list[float], list[float], list[float]]:
    """TTFTs in ms of the baseline's requests, of the others', and the differences
    (other − baseline) of consecutive pairs: requests alternate between two targets, one at
    a time, so a pair shares the deployment's state and drift cancels out. `baseline` is a
    target name (default: "pd-direct", the load generator sending the legs itself)."""
    base_name = baseline or "pd-direct"
    base: list[float] = []
    other: list[float] = []
    pairs: list[float] = []
    for r in results:
        rows = list(zip(r.get("targets", []), r.get("ttfts", []), r.get("errors", []),
                        strict=False))
        for target, ttft, err in rows:
            if not err:
                (base if target == base_name else other).append(ttft * 1000)
        for (ta, a, ea), (tb, b, eb) in zip(rows[::2], rows[1::2], strict=False):
            if not ea and not eb and (ta == base_name) != (tb == base_name):
                pairs.append(1000 * ((b - a) if ta == base_name else (a - b)))
    return base, other, pairs


def side_by_side(run: dict[str, Any] | None, what: str) -> tuple[float | None, str]:
    """Median TTFT of the second target over the first's (requests alternating between two
    deployments up at once), and how the table shows it."""
    first_ms, second_ms, pairs = paired_samples([run or {}], _first_target(run))
    ratio = _ratio(statistics.median(second_ms), statistics.median(first_ms)) if pairs else None
    shown = "—" if ratio is None else (
        f"{statistics.median(second_ms):.0f} / {statistics.median(first_ms):.0f} ms = "
        f"{ratio:.2f} ({what}, {len(pairs)} pairs: {statistics.median(pairs):+.1f} ms)")
    return ratio, shown


def _first_target(r: dict[str, Any] | None) -> str | None:
    targets = (r or {}).get("targets") or [None]
    return targets[0]


def cost_numbers(runs: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per P/D system: median TTFT of the same prompts on P alone and through the proxy, and
    the median paired difference: what disaggregation (transfer, D's first step, the proxy)
    adds to a TTFT that is otherwise P's prefill."""
    out = {}
    for system, r in sorted(runs["cost"].items()):
        targets = list(dict.fromkeys(r.get("targets", [])))
        if len(targets) != 2:
            continue
        # bench_pd.sh names the proxy first and P second: P alone is the baseline
        base, other, pairs = paired_samples([r], targets[1])
        if pairs:
            out[system] = {"p_alone_ms": statistics.median(base),
                           "through_proxy_ms": statistics.median(other),
                           "added_ms": statistics.median(pairs), "pairs": len(pairs)}
    return out


def cost_section(runs: dict[str, Any]) -> list[str]:
    costs = cost_numbers(runs)
    if not costs:
        return ["not measured (see pd_raw/logs)"]
    lines = ["| system | pairs | TTFT on P alone | TTFT through the proxy | added by "
             "disaggregation (paired median) |", "|---|---|---|---|---|"]
    for system, c in costs.items():
        lines.append(f"| {system} | {c['pairs']} | {c['p_alone_ms']:.0f} | "
                     f"{c['through_proxy_ms']:.0f} | {c['added_ms']:+.1f} |")
    if "push" in costs and "pull" in costs and costs["pull"]["added_ms"] > 0:
        lines += ["", f"push adds {costs['push']['added_ms'] / costs['pull']['added_ms']:.2f} "
                  "× what pull adds."]
    return lines


def overhead_section(runs: dict[str, Any]) -> list[str]:
    direct, proxied, pairs = paired_samples(runs["overhead"])
    if not pairs:
        return ["not measured (see pd_raw/logs)"]
    p50 = statistics.median

    def row(label: str, values: list[float]) -> str:
        return f"| {label} | {len(values)} | {p50(values):.1f} |"

    return ["| path | requests | median TTFT (ms) |", "|---|---|---|",
            row("client sends P and D legs itself", direct),
            row("through `pdserve proxy --mode push`", proxied),
            row("proxy − direct, consecutive pairs", pairs)]


# ---- plot ---------------------------------------------------------------------------------


def _latencies(r: dict[str, Any], kind: str | None = None) -> dict[str, list[float]]:
    keep = [i for i, err in enumerate(r.get("errors", []))
            if not err and (kind is None or r["kinds"][i] == kind)]
    return {"TTFT": [r["ttfts"][i] * 1000 for i in keep],
            "ITL": [g * 1000 for i in keep for g in r["itls"][i]]}


def plot(runs: dict[str, Any], path: str) -> None:
    from pdserve.bench.plot import plot_cdf_grid

    grid: dict[str, dict[str, dict[str, list[float]]]] = {}
    rates = sorted({rate for per in runs["A"].values() for rate in per})
    if rates:
        top = rates[-1]
        grid[f"A 1024x64 @ {top:g}/s"] = {s: _latencies(runs["A"][s][top]) for s in SYSTEMS
                                          if top in runs["A"].get(s, {})
                                          and "ttfts" in runs["A"][s][top]}
    grid["mixed workload"] = {s: _latencies(runs["mix"][s]) for s in SYSTEMS
                              if s in runs["mix"] and "ttfts" in runs["mix"][s]}
    grid = {k: v for k, v in grid.items() if v}
    if grid:
        plot_cdf_grid(grid, path, title="pdserve: colocated vs P/D pull vs P/D push")


# ---- main ---------------------------------------------------------------------------------


def _run_date(runs: dict[str, Any]) -> str:
    """When the run started (its first benchmark's date), else now."""
    dates = [r["date"] for per in runs["A"].values() for r in per.values() if "date" in r]
    dates += [r["date"] for r in runs["mix"].values() if "date" in r]
    if dates:
        return min(dates).replace("T", " ").replace("Z", " UTC")
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def render(runs: dict[str, Any], model_dir: str | None, plot_name: str | None) -> str:
    m = machine_info()
    goal_rows, numbers = goals(runs)
    load = runs["loadavg"]
    a_any = next((r for per in runs["A"].values() for r in per.values()), None)
    slos = (a_any or {}).get("goodput_slos_ms", {})
    out = [
        "# P/D benchmark: colocated vs 1P1D pull vs 1P1D push",
        "",
        f"- date: {_run_date(runs)}",
        f"- machine: `nproc` = {m['nproc']}, CPU: {m['cpu']}, kernel {m['kernel']}, "
        f"Python {m['python']}",
        "- load average (1m 5m 15m) by phase: "
        + ("; ".join(f"{p}: {v.strip()}" for p, v in load) if load else "not recorded"),
        "  (other work shared this machine during the run: the numbers are noisy)",
        f"- model: {model_info(model_dir)}",
        "",
        "## Method",
        "",
        "- Each engine is pinned to one core (`taskset`, `OMP_NUM_THREADS=1`). colocated: two "
        "`pdserve serve` (cores 0 and 1), requests round-robin over both by the load generator "
        "(two `--base-url`). pull / push: `pdserve prefill` on core 0, `pdserve decode` on "
        "core 1, `pdserve proxy --mode pull|push`; proxy and load generator are unpinned.",
        "- Workload A: random token-id prompts, 1024 in / 64 out (ignore_eos), Poisson "
        "arrivals. Mixed: 90% 64 in / 64 out, 10% 1024 in / 64 out. Every system gets the "
        "same prompts at the same arrival times (one seed per workload); each system starts "
        "fresh and seeds differ between workloads (no prefix-cache hits).",
        "- Latencies in ms, measured by `pdserve bench serve` on the client. Goodput = "
        "requests/s meeting every SLO: " + (", ".join(f"{k} ≤ {v:g} ms"
                                                       for k, v in slos.items()) or "—") + ".",
        "- Proxy overhead: push deployment, 64 in / 8 out, one request at a time, spaced "
        "(near-periodic arrivals) so each meets an idle deployment, alternating request by "
        "request between the proxy and the load generator sending the same P leg and D leg "
        "itself (`bench serve --base-url PROXY --pd-prefill-url P --pd-decode-url D`): same "
        "engines, same legs, without the proxy's HTTP hop. The overhead is the median of the "
        "TTFT differences of consecutive (direct, proxy) pairs.",
        "",
        "## Goals",
        "",
        *goal_rows,
        "",
        "## Serving results",
        "",
        *serving_table(runs),
        "",
    ]
    if plot_name:
        out += [f"![TTFT and ITL CDFs]({plot_name})", ""]
    out += ["## KV transfer microbenchmark (`pdserve bench transfer --num-tokens 2048`)", "",
            *transfer_section(runs["transfer"]), "",
            "## Proxy overhead", "", *overhead_section(runs), "",
            "## What disaggregation adds to TTFT", "",
            "1024 in / 8 out, one request at a time (near-periodic, 0.5/s), alternating "
            "request by request between the proxy and P itself serving the prompt as a plain "
            "request: the difference is the transfer, D's first step and the proxy; the rest "
            "of the TTFT is P's prefill, the same in both modes.", "",
            *cost_section(runs), "",
            "<!-- numbers: " + json.dumps(numbers) + " -->", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.report", description=__doc__)
    parser.add_argument("--raw", required=True, help="the script's raw results directory")
    parser.add_argument("--out", required=True, help="markdown file to write")
    parser.add_argument("--plot", default=None, help="PNG to write")
    parser.add_argument("--model", default=None, help="model directory (for its shape)")
    args = parser.parse_args(argv)
    runs = load_runs(args.raw)
    plot_name = None
    if args.plot:
        try:
            plot(runs, args.plot)
            plot_name = os.path.relpath(args.plot, os.path.dirname(os.path.abspath(args.out)))
        except ImportError as exc:
            print(f"no plot ({exc}); install matplotlib")
    with open(args.out, "w") as f:
        f.write(render(runs, args.model, plot_name))
    print(open(args.out).read())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
