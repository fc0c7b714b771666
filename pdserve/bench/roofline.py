"""`pdserve bench roofline`: the engine against this machine's own limits, in one run.

Limits (compiled loops in engine/kernels/roofline.cpp, best of --repeats each), for 1
and 2 threads (--threads):
- fp32 FMA peak: `fma_chains` independent FMA chains per thread on the widest vectors present
  (16 with AVX-512's 32 registers, 12 with AVX2's 16: enough for 2 pipes x 4-5 cycles, none
  spilled); GFLOP/s = threads * iters * chains * lanes * 2 / s. Checked against the core:
  `clock_ghz` from a chain of dependent integer adds (one a cycle) and `fma_per_cycle` = the
  vector FMAs a core retired per cycle (at most its FMA issue width, 2 on Zen and Intel cores
  with two FMA pipes); and no gemm may beat it (`mkl_fma_bound`, `prefill_fma_bound` <= 1).
- bf16 dot peak (AVX512-BF16 only, else null): the same with vdpbf16ps, 64 FLOP per
  instruction (16 lanes x 2 bf16 products x multiply+add).
- streaming read: a --buffer-mib float32 buffer (>> L3) summed with wide loads, each thread
  its share; GB/s = bytes / s.
Engine (the real EngineCore in this process, torch.set_num_threads(t), prefix caching off):
- prefill: one fresh prompt of --prefill-tokens T tokens, max_tokens=1: wall time from adding
  the request to its output. FLOPs from the model's shapes, with P = the linear weights of
  all layers (L * (hidden*(q+2kv) + q*hidden + hidden*2*inter + inter*hidden), q = H*D,
  kv = KV*D) and V*hidden for the LM head (one row: only the last token is sampled):
      prefill FLOP = 2*T*P + 2*V*hidden + 2*L*H*D*T*(T+1)
  (the last term: Q K^T and P V over the causal triangle, T(T+1)/2 dot products of D each).
  Reported as GFLOP/s and as a fraction of the fp32 FMA peak at the same thread count.
- decode: one sequence (batch 1) with a --decode-context C token prompt, --decode-steps
  steps after 4 warm-up ones; a step is the interval between consecutive outputs. Bytes per
  step from the shapes (what must come from memory: every weight once, the KV of the context):
      decode bytes = e * (P + V*hidden) + e * 2*L*KV*D*c
  with e the dtype's bytes per element and c the step's mean context length. Reported as
  GB/s and as a fraction of the streaming-read bandwidth at the same thread count (the
  higher of the limit's and one measured right after the decode steps: roofline_batch).
- practical prefill bound (fp32): the sgemm the prefill runs (engine/kernels/linear.py
  large_linear: oneDNN's matmul) timed on this model's own four per-layer matmul shapes at
  --prefill-tokens rows, best of --repeats each, beside torch's F.linear (MKL) on the same
  shapes; sgemm GFLOP/s = their FLOPs / their summed times, and prefill_fma_bound = that / the
  FMA peak: the fraction a prefill would reach if every FLOP (attention included) ran at the
  sgemm's rate and nothing else (norms, rope, activations, KV writes) took any time.
  `gemm_gflops` times each float32 gemm large_linear can choose on its own (the compiled
  sgemm, oneDNN, MKL) and best_gemm_fma_bound is the best of them over the FMA peak; the
  breakdown's other_share is the prefill's time outside matmuls and attention.
- bf16: the same prefill and decode with --dtype bfloat16 on every CPU (without AVX512-BF16
  the kernels widen bf16 to float32 by a shift: half the bytes, the same FMAs);
  bf16_prefill_speedup = fp32 prefill time / bf16 prefill time at the thread
  count where fp32 prefill is fastest.
- decode at batch B and context C (--batch-sizes, default 8 and 32, --batch-context, default
  1024), fp32 and bf16, with where the step's time goes and the bound the CPU allows: see
  pdserve/bench/roofline_batch.py. Result JSON: batch_decode[dtype][B][threads].
Every timing is the best of --repeats (a noisy machine only ever slows a run down).
Result JSON: prefill_fma_fraction and decode_bandwidth_fraction (the best thread count of
each), prefill_fma_bound (at prefill_fma_fraction's thread count), bf16_prefill_speedup,
the raw numbers per thread count, the CPU's model name and flags.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from pdserve.bench import roofline_batch
from pdserve.bench.machine import (
    best_limits,
    cpu_info,
    machine_limits,
    read_against,
    read_gbps,
    stream_buffer,
)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="local Hugging Face model directory")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--decode-context", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="best of N for every timing")
    parser.add_argument("--buffer-mib", type=int, default=512,
                        help="streaming-read buffer (make it >> the L3 cache)")
    parser.add_argument("--fma-iters", type=int, default=20_000_000)
    parser.add_argument("--skip-bf16", action="store_true", help="fp32 only")
    parser.add_argument("--recalibrate", action="store_true",
                        help="first measure the skinny_linear row thresholds again (a quiet "
                             "machine's are the ones to keep)")
    parser.add_argument("--result-json", default=None)
    roofline_batch.add_args(parser)


def model_costs(model: str) -> dict[str, int]:
    """The shape terms of the docstring's formulas: P, V*hidden, L*H*D, L*KV*D."""
    from engine.models import load_arch

    a = load_arch(model)
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    per_layer = (a.hidden_size * (q + 2 * kv) + q * a.hidden_size
                 + a.hidden_size * 2 * a.intermediate_size + a.intermediate_size * a.hidden_size)
    return {"linear_params": a.num_layers * per_layer, "head_params": a.vocab_size * a.hidden_size,
            "attn_hd": a.num_layers * q, "kv_per_token": 2 * a.num_layers * kv}


def prefill_linear_shapes(model: str) -> list[tuple[int, int]]:
    """[out, in] of one layer's four matmuls (q|k|v, o, gate|up, down): the prefill's sgemms."""
    from engine.models import load_arch

    a = load_arch(model)
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    return [(q + 2 * kv, a.hidden_size), (a.hidden_size, q),
            (2 * a.intermediate_size, a.hidden_size), (a.hidden_size, a.intermediate_size)]


def sgemm_gflops(shapes: list[tuple[int, int]], tokens: int, repeats: int,
                 gemm: Any = None) -> float:
    """`gemm` (default: large_linear, the sgemm the engine's prefill calls) on [tokens, in] x
    [out, in]^T for each shape, best of `repeats` each: GFLOP/s over all of them together, in
    float32."""
    import torch

    from engine.kernels.linear import large_linear

    gemm = gemm or large_linear
    flop = seconds = 0.0
    gen = torch.Generator().manual_seed(0)
    for out_f, in_f in shapes:
        x, w = torch.randn(tokens, in_f, generator=gen), torch.randn(out_f, in_f, generator=gen)
        gemm(x, w)  # warm
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            gemm(x, w)
            best = min(best, time.perf_counter() - start)
        flop, seconds = flop + 2.0 * tokens * out_f * in_f, seconds + best
    return flop / seconds / 1e9


def prefill_flop(c: dict[str, int], tokens: int) -> float:
    return (2.0 * tokens * c["linear_params"] + 2.0 * c["head_params"]
            + 2.0 * c["attn_hd"] * tokens * (tokens + 1))


def decode_bytes(c: dict[str, int], context: float, itemsize: int) -> float:
    return itemsize * (c["linear_params"] + c["head_params"] + c["kv_per_token"] * context)


def _request(rid: str, vocab: int, n: int, max_tokens: int, seed: int) -> Any:
    import random

    from engine.protocol import EngineCoreRequest, SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
    return EngineCoreRequest(rid, [rng.randrange(10, vocab) for _ in range(n)], params, None)


def _engine_runs(args: argparse.Namespace, dtype: str, threads: list[int]) -> dict[int, dict]:
    """{threads: {"prefill_s", "decode_step_s", "breakdown_*"}} for one dtype, best of
    --repeats each."""
    import torch

    from engine.client.inproc import InprocClient
    from engine.config import EngineConfig
    from engine.kernels import compiled
    from engine.kernels.linear import skinny_rows, widen_rows
    from engine.models import load_arch
    from pdserve.bench.step import drain

    vocab = load_arch(args.model).vocab_size
    longest = max(args.prefill_tokens, args.decode_context + args.decode_steps + 8)
    config = EngineConfig(model=args.model, dtype=dtype, max_num_seqs=1, max_model_len=longest,
                          num_kv_blocks=longest // 16 + 4, block_size=16,
                          max_num_batched_tokens=longest, enable_prefix_caching=False)
    client = InprocClient(config)
    kern = compiled()
    buf = stream_buffer(args.buffer_mib)  # the limits' streaming read, beside the steps
    out: dict[int, dict] = {}
    try:
        drain(client, [_request("warm", vocab, 64, 2, 0)])
        for t in threads:
            torch.set_num_threads(t)
            skinny_rows(getattr(torch, dtype))  # measured now if new, not inside a timing
            widen_rows(t)
            prefill = decode = float("inf")
            for i in range(args.repeats):
                start = time.perf_counter()
                drain(client, [_request(f"p{t}-{i}", vocab, args.prefill_tokens, 1, i)])
                prefill = min(prefill, time.perf_counter() - start)
                stamps = drain(client, [_request(f"d{t}-{i}", vocab, args.decode_context,
                                                 5 + args.decode_steps, i)])[5:]
                steps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
                decode = min(decode, sorted(steps)[len(steps) // 2])  # a run's median step
            read = read_gbps(kern, buf, t, 3) if kern else None  # beside the decode steps
            shapes = prefill_linear_shapes(args.model)
            sgemm = mkl = None
            gemms: dict[str, float] = {}
            if dtype == "float32":
                sgemm = sgemm_gflops(shapes, args.prefill_tokens, args.repeats)
                mkl = sgemm_gflops(shapes, args.prefill_tokens, args.repeats,
                                   torch.nn.functional.linear)
                gemms = _each_gemm(shapes, args.prefill_tokens, args.repeats)
            breakdowns = [_prefill_breakdown(client, vocab, args.prefill_tokens, f"b{t}-{i}")
                          for i in range(max(1, args.repeats // 2))]
            out[t] = {"prefill_s": prefill, "decode_step_s": decode, "read_gbps": read,
                      "sgemm_gflops": sgemm,
                      "mkl_sgemm_gflops": mkl, "gemm_gflops": gemms,
                      "decode_breakdown": _decode_breakdown(client, vocab, args, f"db{t}"),
                      **min(breakdowns, key=lambda b: b["breakdown_prefill_s"])}
    finally:
        client.shutdown()
    return out


def _each_gemm(shapes: list[tuple[int, int]], tokens: int, repeats: int) -> dict[str, float]:
    """sgemm_gflops of every float32 gemm large_linear can choose (the compiled sgemm where the
    kernel path has it, oneDNN where torch has it, MKL), each on its own: the best of them is
    the best any gemm here reaches on the model's shapes."""
    import torch

    from engine.kernels import linear_kernel
    from engine.kernels.linear import ONEDNN, onednn_linear

    out = {"mkl": torch.nn.functional.linear}
    if ONEDNN:
        out["onednn"] = onednn_linear
    kernel = linear_kernel()
    if kernel is not None and kernel.get_isa() != "scalar":
        out["kernel"] = kernel.sgemm
    return {name: round(sgemm_gflops(shapes, tokens, repeats, fn), 2) for name, fn in out.items()}


def _prefill_breakdown(client: Any, vocab: int, tokens: int, rid: str) -> dict[str, float]:
    """A prefill with the model's matmuls and attention calls timed (apart from the best-of
    runs: the timing wrappers cost a little)."""
    from engine.models import causal_lm, layers
    from engine.runner.attention import PagedAttention
    from pdserve.bench.offline import _timed
    from pdserve.bench.step import drain

    matmul, attention = [0.0], [0.0]
    with _timed([layers, causal_lm], "linear", matmul), \
            _timed([PagedAttention], "__call__", attention):
        start = time.perf_counter()
        drain(client, [_request(rid, vocab, tokens, 1, 99)])
        total = time.perf_counter() - start
    return {"breakdown_prefill_s": total, "breakdown_matmul_s": matmul[0],
            "breakdown_attention_s": attention[0]}


def _decode_breakdown(client: Any, vocab: int, args: argparse.Namespace,
                      rid: str) -> dict[str, float]:
    """Where a batch-1 decode step goes (one separately timed run, wrappers on, the layers as
    Python calls: `python_layers`): per step, the model's matmuls, the attention calls and the
    rest (norms, rope, activations, the sampler, Python), in seconds."""
    from engine.models import causal_lm, layers
    from engine.runner.attention import PagedAttention
    from pdserve.bench.offline import _timed, python_layers

    matmul, attention = [0.0], [0.0]
    client.add_request(_request(rid, vocab, args.decode_context, 5 + args.decode_steps, 7))
    for _ in range(5):  # the prefill and the warm-up steps
        client.get_output()
    steps, done = 0, False
    with python_layers(), _timed([layers, causal_lm], "linear", matmul), \
            _timed([PagedAttention], "__call__", attention):
        start = time.perf_counter()
        while not done:
            out = client.get_output()
            steps += bool(out.outputs)
            done = any(o.finished for o in out.outputs)
        total = (time.perf_counter() - start) / steps
    matmul_s, attention_s = matmul[0] / steps, attention[0] / steps
    return {"step_s": total, "matmul_s": matmul_s, "attention_s": attention_s,
            "other_s": total - matmul_s - attention_s}


def _engine_table(args: argparse.Namespace, dtype: str, runs: dict[int, dict],
                  limits: dict[str, Any]) -> dict[int, dict]:
    costs = model_costs(args.model)
    itemsize = 4 if dtype == "float32" else 2
    context = args.decode_context + 4 + args.decode_steps / 2  # mean over the measured steps
    flop = prefill_flop(costs, args.prefill_tokens)
    nbytes = decode_bytes(costs, context, itemsize)
    t_ = args.prefill_tokens
    matmul_flop = 2.0 * t_ * costs["linear_params"] + 2.0 * costs["head_params"]
    attn_flop = flop - matmul_flop
    table = {}
    for t, r in runs.items():
        lim = limits["threads"][t]
        read = read_against(lim, r.get("read_gbps"))
        gflops, gbps = flop / r["prefill_s"] / 1e9, nbytes / r["decode_step_s"] / 1e9
        table[t] = {"prefill_s": round(r["prefill_s"], 6), "prefill_gflops": round(gflops, 2),
                    "prefill_fma_fraction": round(gflops / lim["fma_gflops"], 3),
                    "decode_step_ms": round(r["decode_step_s"] * 1e3, 3),
                    "decode_gbps": round(gbps, 2), "read_gbps": round(read, 2),
                    "decode_bandwidth_fraction": round(gbps / read, 3)}
        if r["sgemm_gflops"]:
            # The practical bound: every prefill FLOP at the BLAS sgemm's rate on this model's
            # own matmul shapes, and nothing else taking any time.
            table[t]["sgemm_gflops"] = round(r["sgemm_gflops"], 2)
            table[t]["mkl_sgemm_gflops"] = round(r["mkl_sgemm_gflops"], 2)
            table[t]["prefill_fma_bound"] = round(r["sgemm_gflops"] / lim["fma_gflops"], 3)
            table[t]["mkl_fma_bound"] = round(r["mkl_sgemm_gflops"] / lim["fma_gflops"], 3)
            table[t]["gemm_gflops"] = r["gemm_gflops"]  # each gemm on its own
            table[t]["best_gemm_fma_bound"] = round(
                max(r["gemm_gflops"].values()) / lim["fma_gflops"], 3)
        d = r.get("decode_breakdown")
        if d:
            weights = itemsize * (costs["linear_params"] + costs["head_params"])
            table[t]["decode_breakdown"] = {
                "step_ms": round(d["step_s"] * 1e3, 3), "matmul_ms": round(d["matmul_s"] * 1e3, 3),
                "matmul_gbps": round(weights / d["matmul_s"] / 1e9, 2),
                "attention_ms": round(d["attention_s"] * 1e3, 3),
                "other_ms": round(d["other_s"] * 1e3, 3)}
        if lim["bf16_dot_gflops"]:
            table[t]["prefill_bf16_dot_fraction"] = round(gflops / lim["bf16_dot_gflops"], 3)
        # Where one (separately timed) prefill spent its time.
        b = r["breakdown_prefill_s"]
        table[t]["breakdown"] = {
            "prefill_s": round(b, 6),
            "matmul_share": round(r["breakdown_matmul_s"] / b, 3),
            "matmul_gflops": round(matmul_flop / r["breakdown_matmul_s"] / 1e9, 2),
            "attention_share": round(r["breakdown_attention_s"] / b, 3),
            "attention_gflops": round(attn_flop / r["breakdown_attention_s"] / 1e9, 2),
            # the rest: norms, rope, activations, KV writes, sampling, Python and dispatch
            "other_share": round(1 - (r["breakdown_matmul_s"] + r["breakdown_attention_s"]) / b,
                                 3),
        }
    return table


RECALIBRATE_TRIES = 4


def _recalibrate(threads: list[int], model: str) -> None:
    """Measures the kernel choices again at each thread count on the model's layer shapes (the
    keys its engines read; loading it sets them), up to RECALIBRATE_TRIES times while one is
    noisy: a noisy choice is not stored, and the engine would run a default or an old value
    (on a 2-vCPU KVM guest whose second vCPU is shared, 2-thread measurements were noisy in
    about half the tries, and the defaults put batch-32 fp32 decode matmuls on a gemm 2.5x
    slower than the measured choice)."""
    import torch

    from engine.kernels.linear import recalibrate
    from engine.models.loader import load_model

    load_model(model, "float32")  # sets the gemm shapes
    for t in threads:
        torch.set_num_threads(t)
        for _ in range(RECALIBRATE_TRIES):
            got = recalibrate()
            print(f"kernel choices, {t} thr: {got}", flush=True)
            if None not in got.values():
                break


def _print(dtype: str, table: dict[int, dict], limits: dict[str, Any]) -> None:
    for t, r in table.items():
        lim = limits["threads"][t]
        print(f"{dtype:8s} {t} thr  prefill {r['prefill_gflops']:7.1f} GFLOP/s = "
              f"{r['prefill_fma_fraction']:.2f} of fp32 FMA peak {lim['fma_gflops']:.1f}"
              + (f" (sgemm bound {r['prefill_fma_bound']:.2f})" if "prefill_fma_bound" in r
                 else "") + "  |  "
              f"decode {r['decode_gbps']:6.2f} GB/s = {r['decode_bandwidth_fraction']:.2f} of "
              f"stream read {r['read_gbps']:.2f}", flush=True)
        d = r.get("decode_breakdown")
        if d:
            print(f"{dtype:8s} {t} thr  decode batch   1 step {d['step_ms']:.2f} ms: matmul "
                  f"{d['matmul_ms']:.2f} ms ({d['matmul_gbps']:.2f} GB/s of weights), attention "
                  f"{d['attention_ms']:.2f} ms, other {d['other_ms']:.2f} ms", flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    threads = [int(t) for t in args.threads.split(",")]
    if args.recalibrate:
        _recalibrate(threads, args.model)
    limits = machine_limits(threads, args.repeats, args.buffer_mib, args.fma_iters)
    # bf16 on every CPU with a vector path: without AVX512-BF16 the kernels widen bf16 to fp32
    dtypes = ["float32"] + ([] if args.skip_bf16 else ["bfloat16"])
    runs = {dt: _engine_runs(args, dt, threads) for dt in dtypes}
    batch_runs = {dt: roofline_batch.batch_runs(args, dt, threads) for dt in dtypes}
    # Measured again after the engine runs, the best of both kept: the clock boosts with the
    # load on the other cores, and a limit must not be taken at a moment slower than the runs.
    limits = best_limits(limits, machine_limits(threads, args.repeats, args.buffer_mib,
                                                args.fma_iters))
    for t, lim in limits["threads"].items():
        print(f"limits   {t} thr  fp32 FMA {lim['fma_gflops']:.1f} GFLOP/s ("
              f"{lim.get('fma_per_cycle')} FMA/cycle at {lim.get('clock_ghz')} GHz)  bf16 dot "
              f"{lim['bf16_dot_gflops'] or 'n/a'}  stream read {lim['read_gbps']:.2f} GB/s",
              flush=True)
    tables = {dt: _engine_table(args, dt, runs[dt], limits) for dt in dtypes}
    costs = model_costs(args.model)
    batch = {dt: roofline_batch.batch_table(args, dt, batch_runs[dt], limits, costs)
             for dt in dtypes}
    for dt, table in tables.items():
        _print(dt, table, limits)
        roofline_batch.print_table(dt, batch[dt])
    fp32 = tables["float32"]
    for t, r in fp32.items():
        if max(r.get("prefill_fma_bound") or 0, r.get("mkl_fma_bound") or 0) > 1.0:
            print(f"WARNING: at {t} thr a gemm beat the FMA peak: the peak under-measures"
                  f"{_standin_hint(limits)}", flush=True)
    best_p = max(fp32, key=lambda t: fp32[t]["prefill_fma_fraction"])
    best_d = max(fp32, key=lambda t: fp32[t]["decode_bandwidth_fraction"])
    fastest = min(fp32, key=lambda t: fp32[t]["prefill_s"])
    result: dict[str, Any] = {
        "model": args.model, "cpu": cpu_info(), "limits": limits,
        "costs": model_costs(args.model), "prefill_tokens": args.prefill_tokens,
        "decode_context": args.decode_context, "float32": fp32,
        "prefill_fma_fraction": fp32[best_p]["prefill_fma_fraction"],
        "prefill_fma_fraction_threads": best_p,
        "prefill_fma_bound": fp32[best_p].get("prefill_fma_bound"),
        "decode_bandwidth_fraction": fp32[best_d]["decode_bandwidth_fraction"],
        "decode_bandwidth_fraction_threads": best_d,
        "bf16_prefill_speedup": None, "bfloat16": None,
        "batch_decode": batch,
    }
    if "bfloat16" in tables:
        bf16 = result["bfloat16"] = tables["bfloat16"]
        result["bf16_prefill_speedup"] = round(
            fp32[fastest]["prefill_s"] / bf16[fastest]["prefill_s"], 3)
        result["bf16_prefill_speedup_threads"] = fastest
    print(f"prefill_fma_fraction {result['prefill_fma_fraction']} ({best_p} thr, bound "
          f"{result['prefill_fma_bound']})  "
          f"decode_bandwidth_fraction {result['decode_bandwidth_fraction']} ({best_d} thr)  "
          f"bf16_prefill_speedup {result['bf16_prefill_speedup']}")
    return result


def _standin_hint(limits: dict[str, Any]) -> str:
    """Why a forced narrower path's peak is beaten: a library left on the wider vectors."""
    env = limits.get("isa_env") or {}
    if not env.get("PDSERVE_ISA"):
        return ""
    unset = [v for v in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS") if not env.get(v)]
    return f" (PDSERVE_ISA={env['PDSERVE_ISA']} without {', '.join(unset)}: those gemms " \
        "still use this CPU's widest vectors)" if unset else ""


def main(args: argparse.Namespace) -> int:
    result = run(args)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
