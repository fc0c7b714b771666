"""`pdserve bench offline`: our LLM.generate against transformers' batched generate.

Both run in the same process on the same random prompts (fixed input length, greedy,
exactly --output-len new tokens each), one after the other, in the same --dtype (float32 or
bfloat16: weights, activations, and our KV cache); the result is the ratio of their
output-token throughputs.

--matmul-time also reports how long each spent in its matmuls (the model's linear layers,
timed call by call; ours then runs its EngineCore in-process so the calls can be timed).
Both multiply the same float32 weights by the same tokens, so the matmul time bounds what
any engine on the same matmul library can gain.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import time
from collections.abc import Iterator
from typing import Any

from pdserve.bench.output import emit


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="local Hugging Face model directory, .gguf file or alias")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="weights and KV dtype of both engines")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--hf-batch-size", type=int, default=0,
                        help="transformers batch size (0 = all prompts at once)")
    parser.add_argument("--skip-hf", action="store_true", help="measure only pdserve")
    parser.add_argument("--matmul-time", action="store_true",
                        help="also time the matmuls of both (ours runs in-process then)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="run ours with this many TP worker processes")
    parser.add_argument("--compare-tp", type=int, default=0, metavar="N",
                        help="also run ours at TP=1 and TP=N (alternating, twice each) and "
                             "report their throughput ratio; torch threads are split over "
                             "the ranks (TP=1 uses them all)")
    parser.add_argument("--result-json", default=None)


def _prompts(model: str, n: int, length: int, seed: int) -> list[list[int]]:
    from engine.models import load_arch, load_tokenizer

    vocab = load_arch(model).vocab_size
    special = set(load_tokenizer(model).all_special_ids)
    rng = random.Random(seed)
    allowed = [t for t in range(vocab) if t not in special]
    return [[rng.choice(allowed) for _ in range(length)] for _ in range(n)]


@contextlib.contextmanager
def _timed(owners: list[Any], name: str, total: list[float]) -> Iterator[None]:
    """Replaces owner.name (the same function in each owner) by a wrapper adding its wall time
    to total[0]; restores it on exit."""
    real = getattr(owners[0], name)

    def wrapper(*a: Any, **kw: Any) -> Any:
        start = time.perf_counter()
        try:
            return real(*a, **kw)
        finally:
            total[0] += time.perf_counter() - start

    for owner in owners:
        setattr(owner, name, wrapper)
    try:
        yield
    finally:
        for owner in owners:
            setattr(owner, name, real)


@contextlib.contextmanager
def python_layers() -> Iterator[None]:
    """The decoder layers run as Python calls while in scope (CausalLM's compiled DecodeStack
    off): the timing wrappers on `linear` and PagedAttention see only those calls (the stack
    makes them in C++)."""
    from engine.models.causal_lm import CausalLM

    real = CausalLM._decode_stack
    CausalLM._decode_stack = lambda *a: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        CausalLM._decode_stack = real  # type: ignore[method-assign]


def _run_ours(args: argparse.Namespace, prompts: list[list[int]],
              tp: int | None = None) -> tuple[float, float]:
    """(output tokens/s, seconds in matmuls or 0)."""
    from engine import LLM, SamplingParams
    from engine.models import causal_lm, layers

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              tensor_parallel_size=tp or args.tensor_parallel_size,
              multiprocess=not args.matmul_time)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    matmul = [0.0]
    with contextlib.ExitStack() as timing:
        if args.matmul_time:
            timing.enter_context(python_layers())
            timing.enter_context(_timed([layers, causal_lm], "linear", matmul))
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    llm.shutdown()
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return produced / elapsed, matmul[0]


def _hf_model(auto_cls: Any, model: str, dtype: Any) -> Any:
    """transformers' own load of MODEL: a directory, or a GGUF file (gguf_file=, which it
    dequantizes or keeps packed as it sees fit)."""
    import os

    from engine.models.source import is_gguf, resolve_model

    path = resolve_model(model)
    if is_gguf(path):
        return auto_cls.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                        dtype=dtype).eval()
    return auto_cls.from_pretrained(path, dtype=dtype).eval()


def _run_hf(args: argparse.Namespace, prompts: list[list[int]]) -> tuple[float, float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = _hf_model(AutoModelForCausalLM, args.model, getattr(torch, args.dtype))
    bs = args.hf_batch_size or len(prompts)
    produced = 0
    matmul = [0.0]
    timing = (_timed([torch.nn.Linear], "forward", matmul) if args.matmul_time
              else contextlib.nullcontext())
    with torch.inference_mode(), timing:
        model.generate(torch.tensor(prompts[:2]), max_new_tokens=2, do_sample=False)
        matmul[0] = 0.0
        start = time.perf_counter()
        for i in range(0, len(prompts), bs):
            batch = torch.tensor(prompts[i:i + bs])
            out = model.generate(
                batch, attention_mask=torch.ones_like(batch), max_new_tokens=args.output_len,
                min_new_tokens=args.output_len, do_sample=False,
            )
            produced += (out.shape[1] - batch.shape[1]) * batch.shape[0]
        elapsed = time.perf_counter() - start
    return produced / elapsed, matmul[0]


def _compare_tp(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """TP=1 and TP=N alternating (1, N, 1, N); the best run of each (the machine is noisy),
    and each adjacent pair's ratio with the load before each run (a shared machine's load
    moves between runs: a pair's ratio is the one measured side by side)."""
    import torch

    from pdserve.bench.machine import cpu_info

    n = args.compare_tp
    load = os.getloadavg()[0]
    runs: dict[int, list[float]] = {1: [], n: []}
    loads: list[float] = []
    for tp in (1, n, 1, n):
        loads.append(round(os.getloadavg()[0], 2))
        runs[tp].append(_run_ours(args, prompts, tp)[0])
    one, many = max(runs[1]), max(runs[n])
    threads = torch.get_num_threads()
    return {"tp1_tokens_per_s": round(one, 1), f"tp{n}_tokens_per_s": round(many, 1),
            "tp_ratio": round(many / one, 3), "tp1_threads": threads,
            "threads_per_rank": max(1, threads // n),
            "runs_tokens_per_s": {f"tp{k}": [round(v, 1) for v in vs] for k, vs in runs.items()},
            "pair_ratios": [round(b / a, 3) for a, b in zip(runs[1], runs[n], strict=True)],
            "load_average_before": round(load, 2), "load_average_per_run": loads,
            "load_average_after": round(os.getloadavg()[0], 2), "cpu": cpu_info()}


def main(args: argparse.Namespace) -> int:
    prompts = _prompts(args.model, args.num_prompts, args.input_len, args.seed)
    if args.compare_tp:
        result = {"model": args.model, "num_prompts": args.num_prompts,
                  "input_len": args.input_len, "output_len": args.output_len,
                  **_compare_tp(args, prompts)}
        emit(result, args.result_json)
        return 0
    ours, ours_mm = _run_ours(args, prompts)
    result: dict[str, Any] = {
        "model": args.model, "dtype": args.dtype, "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len, "tokens_per_s": round(ours, 1),
        "tensor_parallel_size": args.tensor_parallel_size,
    }
    if args.matmul_time:
        result.update(multiprocess=False, matmul_s=round(ours_mm, 3))
    if not args.skip_hf:
        hf, hf_mm = _run_hf(args, prompts)
        result.update(hf_tokens_per_s=round(hf, 1), ratio=round(ours / hf, 3))
        if args.matmul_time:
            produced = args.num_prompts * args.output_len
            hf_s = produced / hf
            # The best ratio an engine could reach if it spent only transformers' matmul time.
            result.update(hf_matmul_s=round(hf_mm, 3), hf_matmul_share=round(hf_mm / hf_s, 3),
                          ratio_bound_at_hf_matmul_time=round(hf_s / hf_mm, 3))
    emit(result, args.result_json)
    return 0
