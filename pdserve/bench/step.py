"""`pdserve bench step`: mean engine-step time, multiprocess (ZeroMQ) vs in-process.

Both runs happen in one invocation on the same prompts: `--concurrency` requests decode
together (greedy, ignore_eos, same length, so the batch stays full until the end). A step's
wall time is the interval between consecutive output batches seen by the client, measured
over the decode steps after `--warmup-steps`:
- in-process (InprocClient): each `get_output()` is exactly one step on the caller's thread;
- multiprocess (SyncMPClient): the core steps in its own process; the interval includes
  everything on the path (busy loop, output encoding, socket, decoding in the frontend).
Result JSON: {"inproc_step_ms", "mp_step_ms", "ratio" = mp / inproc, ...}.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="local Hugging Face model directory")
    parser.add_argument("--concurrency", type=int, default=32, help="requests decoding at once")
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--steps", type=int, default=64, help="decode steps measured")
    parser.add_argument("--warmup-steps", type=int, default=4)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json", default=None)


def _config(args: argparse.Namespace) -> Any:
    from engine.config import EngineConfig

    per_req = args.input_len + args.warmup_steps + args.steps + 2
    blocks = args.num_kv_blocks or args.concurrency * (-(-per_req // args.block_size)) + 8
    return EngineConfig(model=args.model, num_kv_blocks=blocks, block_size=args.block_size,
                        max_num_seqs=max(args.concurrency, 1), seed=args.seed,
                        max_num_batched_tokens=max(2048, args.concurrency * args.input_len))


def _requests(args: argparse.Namespace, tag: str) -> list[Any]:
    from engine.models.formats import load_arch
    from engine.protocol import EngineCoreRequest, SamplingParams

    vocab = load_arch(args.model).vocab_size
    rng = random.Random(args.seed)
    params = SamplingParams(temperature=0.0, ignore_eos=True,
                            max_tokens=1 + args.warmup_steps + args.steps)
    return [EngineCoreRequest(f"{tag}-{i}", [rng.randrange(10, vocab) for _ in
                                             range(args.input_len)], params, None)
            for i in range(args.concurrency)]


def _measure(client: Any, args: argparse.Namespace, tag: str) -> dict[str, float]:
    """Add the batch, read every output batch, return step-interval statistics (ms)."""
    from engine.protocol import EngineCoreRequest, SamplingParams

    warm = EngineCoreRequest(f"{tag}-warm", [11, 12, 13],
                             SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                             None)
    drain(client, [warm])
    stamps = drain(client, _requests(args, tag))
    # stamps[0] is the prefill step; decode steps follow. Skip the warm-up decode steps.
    times = stamps[1 + args.warmup_steps:]
    intervals = [(b - a) * 1000 for a, b in zip(times, times[1:], strict=False)]
    if not intervals:
        raise RuntimeError("too few steps measured: raise --steps")
    return {"mean": statistics.fmean(intervals), "median": statistics.median(intervals),
            "steps": len(intervals)}


def drain(client: Any, requests: list[Any]) -> list[float]:
    """Add the requests, step until all finish; the perf_counter time of each output batch."""
    ids = {r.request_id for r in requests}
    for r in requests:
        client.add_request(r)
    stamps: list[float] = []
    while ids:
        out = client.get_output()
        if not out.outputs:
            continue
        stamps.append(time.perf_counter())
        for o in out.outputs:
            if o.finished:
                ids.discard(o.request_id)
    return stamps


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine.client.inproc import InprocClient
    from engine.client.mp_client import SyncMPClient

    config = _config(args)
    inproc = InprocClient(config)
    try:
        ip = _measure(inproc, args, "inproc")
    finally:
        inproc.shutdown()
    mp = SyncMPClient(config)
    try:
        mpr = _measure(mp, args, "mp")
    finally:
        mp.shutdown()
    return {
        "inproc_step_ms": round(ip["mean"], 4),
        "mp_step_ms": round(mpr["mean"], 4),
        "ratio": round(mpr["mean"] / ip["mean"], 4),
        "inproc_step_median_ms": round(ip["median"], 4),
        "mp_step_median_ms": round(mpr["median"], 4),
        "concurrency": args.concurrency,
        "steps": int(mpr["steps"]),
    }


def main(args: argparse.Namespace) -> dict[str, Any]:
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if getattr(args, "result_json", None):
        with open(args.result_json, "w") as f:
            f.write(text + "\n")
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    add_args(p)
    main(p.parse_args())
