"""`pdserve bench serve`: an async load generator for any OpenAI-compatible completions endpoint.

Sends `--num-prompts` streamed completions (random token-id prompts of a fixed length, a
weighted mix of such classes, or a JSONL dataset) at `--request-rate` requests/s (gamma
inter-arrival times, `--burstiness` 1 = Poisson; inf = all at once), optionally capped at
`--max-concurrency` in flight, and reports vLLM `bench serve`'s metrics (TTFT, TPOT, ITL,
E2EL; throughputs; goodput under `--goodput` SLOs) on stdout and in `--result-json`.

Targets:
  - one or more `--base-url`: requests go round-robin over them (request i → URL i mod k),
    which is how a set of colocated engines is benchmarked without a load balancer;
  - `--pd-prefill-url` + `--pd-decode-url`: the client itself sends each request's P leg and
    D leg at once (push mode, no proxy in between) — the baseline for the proxy's overhead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from datetime import datetime, timezone
from typing import Any

import httpx

from pdserve.bench.arrivals import send_offsets
from pdserve.bench.client import (
    RequestResult,
    completion_payload,
    fetch_prefill_info,
    send_completion,
    send_pd_direct,
)
from pdserve.bench.metrics import (
    METRICS,
    parse_goodput,
    parse_percentiles,
    summarize,
    summarize_by_kind,
)
from pdserve.bench.workload import (
    BenchRequest,
    jsonl_requests,
    mixed_requests,
    parse_mix,
    random_requests,
    token_pool,
)


def add_args(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", action="append", default=None, metavar="URL",
                        help="server to load, e.g. http://127.0.0.1:8000; repeat it to spread "
                        "requests round-robin over several (default: http://127.0.0.1:8000)")
    target.add_argument("--endpoint", default="/v1/completions",
                        help="completions path on each server (default: /v1/completions)")
    target.add_argument("--model", default=None,
                        help="model name sent in each request (default: the first of "
                        "GET /v1/models); if it is a local directory its vocabulary is used")
    target.add_argument("--tokenizer", default=None, metavar="MODEL_DIR",
                        help="local model directory whose vocabulary random prompts draw from")
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    target.add_argument("--pd-prefill-url", default=None, metavar="URL",
                        help="with --pd-decode-url: play the push proxy's part (no proxy); "
                        "given with --base-url too, requests alternate between the base URLs "
                        "and this direct pair (results also per target: `by_target`)")
    target.add_argument("--pd-decode-url", default=None, metavar="URL")
    target.add_argument("--request-timeout", type=float, default=600.0, metavar="S")

    load = parser.add_argument_group("workload")
    load.add_argument("--num-prompts", type=int, default=100)
    load.add_argument("--random-input-len", type=int, default=1024)
    load.add_argument("--random-output-len", type=int, default=128,
                      help="tokens per request (also the default for JSONL lines without "
                      "output_len)")
    load.add_argument("--random-mix", default=None, metavar="W:IN:OUT,…",
                      help="weighted classes of random requests instead of one shape, e.g. "
                      "'0.9:64:64,0.1:1024:64' (exact proportions, seeded order)")
    load.add_argument("--dataset-path", default=None,
                      help='JSONL, one {"prompt": str | [ids], "output_len"?: int} a line '
                      "(cycled if shorter than --num-prompts)")
    load.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                      help="generate exactly output_len tokens (default: on for random "
                      "prompts, off for a dataset)")
    load.add_argument("--request-rate", type=float, default=math.inf,
                      help="requests/s (default: inf = all at once)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the inter-arrival times; 1 = Poisson")
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="most requests in flight at once (default: no limit)")
    load.add_argument("--num-warmups", type=int, default=1,
                      help="untimed requests before the run (their own random prompts)")
    load.add_argument("--seed", type=int, default=0)

    out = parser.add_argument_group("results")
    out.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                     help="SLOs (ttft, tpot, e2el in ms) for the goodput metric")
    out.add_argument("--metric-percentiles", default="50,90,99")
    out.add_argument("--result-json", default=None)
    out.add_argument("--save-detailed", action="store_true",
                     help="also store per-request ttfts, itls, e2els, lengths, errors")
    out.add_argument("--label", default=None, help="a name stored in the result JSON")
    out.add_argument("--plot", default=None, metavar="FILE.png",
                     help="write TTFT and ITL CDFs (needs matplotlib)")
    out.add_argument("--disable-tqdm", action="store_true")


# ---- set-up -------------------------------------------------------------------------------


def _check_args(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    if args.random_input_len < 1 or args.random_output_len < 1:
        raise ValueError("--random-input-len and --random-output-len must be at least 1")
    if args.num_warmups < 0:
        raise ValueError("--num-warmups must be >= 0")
    if not args.endpoint.startswith("/") or "chat" in args.endpoint:
        raise ValueError(f"--endpoint {args.endpoint!r}: a completions path such as "
                         "/v1/completions is needed (chat is not supported)")
    if bool(args.pd_prefill_url) != bool(args.pd_decode_url):
        raise ValueError("--pd-prefill-url and --pd-decode-url go together")
    if args.dataset_path and args.random_mix:
        raise ValueError("give --dataset-path or --random-mix, not both")


def build_workload(args: argparse.Namespace) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """(the timed requests, the warm-up requests); warm-ups never share a prompt with them."""
    vocab_dir = args.tokenizer or (args.model if args.model and os.path.exists(args.model)
                                   else None)
    pool = token_pool(vocab_dir)
    if args.dataset_path:
        requests = jsonl_requests(args.dataset_path, args.num_prompts, args.random_output_len)
        warm_len, warm_out = 16, 4
    elif args.random_mix:
        requests = mixed_requests(args.num_prompts, parse_mix(args.random_mix), pool, args.seed)
        warm_len, warm_out = requests[0].prompt_len or 16, 4
    else:
        requests = random_requests(args.num_prompts, args.random_input_len,
                                   args.random_output_len, pool, args.seed)
        warm_len, warm_out = args.random_input_len, 4
    warmups = random_requests(args.num_warmups, warm_len, warm_out, pool,
                              args.seed + 1_000_003, "warmup")
    return requests, warmups


async def _model_name(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> str:
    resp = await client.get(url.rstrip("/") + "/v1/models", headers=headers)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise ValueError(f"{url}/v1/models lists no model; pass --model")
    return data[0]["id"]


# ---- the run ------------------------------------------------------------------------------


class Target:
    """Sends one request to the configured target(s); round-robin over base URLs."""

    def __init__(self, args: argparse.Namespace, client: httpx.AsyncClient,
                 headers: dict[str, str]) -> None:
        self.client, self.headers, self.args = client, headers, args
        self.urls = [u.rstrip("/") + args.endpoint for u in args.base_url or []]
        self.pd = (args.pd_prefill_url.rstrip("/") + args.endpoint,
                   args.pd_decode_url.rstrip("/") + args.endpoint) if args.pd_prefill_url else None
        self.pd_info = None
        self.model = ""
        self.ignore_eos = False

    async def prepare(self) -> None:
        args = self.args
        first = args.pd_decode_url or args.base_url[0]
        if args.model and not os.path.isdir(args.model):
            self.model = args.model
        else:
            self.model = await _model_name(self.client, first, self.headers)
        if self.pd is not None:
            self.pd_info = await fetch_prefill_info(self.client, args.pd_prefill_url)

    @property
    def names(self) -> list[str]:
        """One name per target, in round-robin order: each base URL, then the direct P/D pair."""
        return [*(self.args.base_url or []), *(["pd-direct"] if self.pd is not None else [])]

    async def send(self, index: int, req: BenchRequest, t0: float) -> RequestResult:
        payload = completion_payload(req, self.model, self.ignore_eos)
        slot = index % len(self.names)
        if slot == len(self.urls):
            result = await send_pd_direct(self.client, self.pd[0], self.pd[1], self.pd_info,
                                          payload, req, self.headers, t0)
        else:
            result = await send_completion(self.client, self.urls[slot], payload, req,
                                           self.headers, t0)
        result.target = self.names[slot]
        return result


async def _warm_up(target: Target, warmups: list[BenchRequest]) -> None:
    for i, req in enumerate(warmups):
        result = await target.send(i, req, time.perf_counter())
        if not result.success:
            raise RuntimeError(f"warm-up request failed: {result.error}")


async def run_benchmark(args: argparse.Namespace, requests: list[BenchRequest],
                        warmups: list[BenchRequest]) -> tuple[list[RequestResult], float, str]:
    """Returns (results in request order, duration in s, model name)."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        target = Target(args, client, headers)
        target.ignore_eos = (args.ignore_eos if args.ignore_eos is not None
                             else not args.dataset_path)
        await target.prepare()
        await _warm_up(target, warmups)
        offsets = send_offsets(len(requests), args.request_rate, args.burstiness, args.seed)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = _progress(len(requests), args.disable_tqdm)

        async def one(i: int, req: BenchRequest, t0: float) -> RequestResult:
            try:
                if sem is None:
                    return await target.send(i, req, t0)
                async with sem:
                    return await target.send(i, req, t0)
            finally:
                if bar is not None:
                    bar.update(1)

        t0 = time.perf_counter()
        tasks = []
        for i, (req, offset) in enumerate(zip(requests, offsets, strict=True)):
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(i, req, t0)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
        if bar is not None:
            bar.close()
    return results, duration, target.model


def _progress(total: int, disabled: bool) -> Any:
    if disabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", file=sys.stderr)


# ---- output -------------------------------------------------------------------------------


def build_result(args: argparse.Namespace, results: list[RequestResult], duration: float,
                 model: str) -> dict[str, Any]:
    percentiles = parse_percentiles(args.metric_percentiles)
    slos = parse_goodput(args.goodput)
    out: dict[str, Any] = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "label": args.label,
        "model": model,
        "base_urls": args.base_url,
        "pd_direct": [args.pd_prefill_url, args.pd_decode_url] if args.pd_prefill_url else None,
        "endpoint": args.endpoint,
        "num_prompts": len(results),
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "workload": (f"jsonl:{args.dataset_path}" if args.dataset_path else
                     f"mix:{args.random_mix}" if args.random_mix else
                     f"random:{args.random_input_len}x{args.random_output_len}"),
    }
    out.update(summarize(results, duration, percentiles=percentiles, slos=slos))
    if len({r.kind for r in results}) > 1:
        out["by_kind"] = summarize_by_kind(results, duration, percentiles=percentiles,
                                           slos=slos)
    if len({r.target for r in results}) > 1:
        out["by_target"] = summarize_by_kind(results, duration, percentiles=percentiles,
                                             slos=slos, key="target")
    errors = [r.error for r in results if not r.success]
    out["first_errors"] = errors[:5]
    if args.save_detailed:
        out.update(
            kinds=[r.kind for r in results],
            targets=[r.target for r in results],
            input_lens=[r.prompt_len for r in results],
            output_lens=[r.output_tokens for r in results],
            ttfts=[r.ttft for r in results],
            itls=[r.itl for r in results],
            e2els=[r.latency for r in results],
            starts=[r.start for r in results],
            errors=[r.error for r in results],
        )
    return out


def print_result(result: dict[str, Any]) -> None:
    line = "=" * 50
    print(f"{' Serving Benchmark Result ':=^50}")
    rows = [
        ("Successful requests:", result["completed"]),
        ("Failed requests:", result["failed"]),
        ("Benchmark duration (s):", f"{result['duration']:.2f}"),
        ("Total input tokens:", result["total_input_tokens"]),
        ("Total generated tokens:", result["total_output_tokens"]),
        ("Request throughput (req/s):", f"{result['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{result['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{result['total_token_throughput']:.2f}"),
    ]
    if "request_goodput" in result:
        rows.append(("Request goodput (req/s):", f"{result['request_goodput']:.2f}"))
    for label, value in rows:
        print(f"{label:<40}{value:<10}")
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for m in METRICS:
        print(f"{titles[m]:-^50}")
        print(f"{f'Mean {m.upper()} (ms):':<40}{result[f'mean_{m}_ms']:<10.2f}")
        print(f"{f'Median {m.upper()} (ms):':<40}{result[f'median_{m}_ms']:<10.2f}")
        for p, v in result[f"percentiles_{m}_ms"]:
            print(f"{f'P{p:g} {m.upper()} (ms):':<40}{v:<10.2f}")
    print(line)
    for err in result["first_errors"]:
        print(f"error: {err}", file=sys.stderr)


def _plot(path: str, results: list[RequestResult], label: str) -> None:
    from pdserve.bench.plot import plot_cdfs

    ok = [r for r in results if r.success]
    plot_cdfs({label: {"TTFT": [r.ttft * 1000 for r in ok],
                       "ITL": [g * 1000 for r in ok for g in r.itl]}}, path, title=label)


def main(args: argparse.Namespace) -> int:
    try:
        _check_args(args)
        parse_goodput(args.goodput)
        parse_percentiles(args.metric_percentiles)
        if not args.pd_prefill_url and not args.base_url:
            args.base_url = ["http://127.0.0.1:8000"]
        requests, warmups = build_workload(args)
    except (ValueError, OSError) as exc:
        print(f"pdserve bench serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        results, duration, model = asyncio.run(run_benchmark(args, requests, warmups))
    except (httpx.HTTPError, RuntimeError, ValueError) as exc:
        print(f"pdserve bench serve: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    result = build_result(args, results, duration, model)
    print_result(result)
    if args.result_json:
        parent = os.path.dirname(os.path.abspath(args.result_json))
        os.makedirs(parent, exist_ok=True)
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        _plot(args.plot, results, args.label or result["workload"])
    return 0 if result["completed"] else 1
