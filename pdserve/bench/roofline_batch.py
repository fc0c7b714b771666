"""`pdserve bench roofline`: decode at batch B and context C against the streaming read.

A decode step at batch B reads every weight once plus every running sequence's KV; at B = 8
and C = 1024 the KV read equals the weights' (issue 33). For each dtype one engine (prefix
caching off, so no two sequences share a KV block) prefills the largest batch once, B
distinct random prompts of --batch-context tokens; for each thread count, 2 warm-up steps,
then --repeats runs of --batch-steps steps each, a run's median step, the best run kept.
Then the longest-running requests beyond the next smaller B are aborted and the same is
measured for it (its sequences a few steps longer: the bytes count each one's own context).
Bytes per step, each sequence b at context c_b (its prompt plus the tokens it has so far):
    batch decode bytes = e * (P + V*hidden) + e * 2*L*KV*D * sum_b c_b
against the streaming read at the same thread count (`decode_bandwidth_fraction`): the
higher of the machine limit's and one measured right after the timed runs (`read_gbps`, the
--buffer-mib read, best of 3). A VM's memory bandwidth can change within a run (two vCPUs
of a Zen 5 EPYC guest streamed 41 GB/s together in one minute and 78-83 the next): against
a limit taken in a slow minute, a step measured in a fast one read "1.03 of the stream".
Where the time goes (one separately timed run of --batch-steps steps, wrappers on, the layers
as Python calls: the compiled DecodeStack makes them where no wrapper sees them): the
model's matmuls (`matmul_ms` a step), the attention calls (`attention_ms`, with the KV's
GB/s), and the rest (`other_ms`: norms, rope, activations, the sampler, the runner's and
the scheduler's Python). And the bound this CPU allows (`bound_fraction`): the same bytes
over the streaming read, against a step whose matmuls take their FLOPs (2 * B * (P +
V*hidden)) at the fp32 FMA peak (bf16: the bf16 dot peak where there is one) or their
weights' read, whichever is longer, plus the KV's
read: at B = 32 the matmuls' FLOPs alone can outlast the whole step's bytes on a CPU with a
low FMA peak (2 cores with AVX2).
And the attention kernel's own bound (`attention_alone`): the compiled paged_decode alone, every
layer once, over a KV cache of the model's shape holding B sequences of C tokens on their own
blocks (huge pages, as the engine allocates it), against a streaming read of the same number of
bytes timed beside it (best of --repeats each, alternating): `kv_gbps` and `read_fraction`.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from pdserve.bench.machine import read_against, read_gbps, stream_buffer


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", default="8,32",
                        help="decode batch sizes measured at --batch-context ('' skips)")
    parser.add_argument("--batch-context", type=int, default=1024)
    parser.add_argument("--batch-steps", type=int, default=12)


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, vocab) for _ in range(n)]


class _Batch:
    """The running requests and each one's token count (its context for the next step)."""

    def __init__(self, client: Any, context: int) -> None:
        self.client, self.context = client, context
        self.tokens: dict[str, int] = {}

    def step(self) -> tuple[int, int]:
        """One engine step: (sequences that got a token, their summed context read)."""
        read = sum(self.tokens.values())
        out = self.client.get_output()
        for o in out.outputs:
            if o.request_id in self.tokens:
                self.tokens[o.request_id] += len(o.new_token_ids)
                if o.finished:
                    raise RuntimeError(f"{o.request_id} finished early: raise max_tokens")
        return len(out.outputs), read

    def timed(self, steps: int, batch: int) -> tuple[float, float]:
        """(median step seconds, mean summed context) over `steps` steps of the full batch."""
        times, reads = [], []
        for _ in range(steps):
            start = time.perf_counter()
            n, read = self.step()
            times.append(time.perf_counter() - start)
            reads.append(read)
            if n != batch:
                raise RuntimeError(f"a step ran {n} sequences, not {batch}")
        return sorted(times)[len(times) // 2], sum(reads) / len(reads)


def batch_runs(args: argparse.Namespace, dtype: str, threads: list[int]) -> dict[int, dict]:
    """{B: {threads: {"step_s", "context_sum", "matmul_s", "attention_s", "profile_step_s",
    "read_gbps"}}} for one dtype."""
    import torch

    from engine.client.inproc import InprocClient
    from engine.config import EngineConfig
    from engine.kernels import compiled
    from engine.kernels.linear import skinny_rows
    from engine.models import causal_lm, layers, load_arch
    from engine.protocol import EngineCoreRequest, SamplingParams
    from engine.runner.attention import PagedAttention
    from pdserve.bench.offline import _timed, python_layers

    sizes = sorted((int(b) for b in args.batch_sizes.split(",") if b), reverse=True)
    if not sizes:
        return {}
    kern = compiled()
    buf = stream_buffer(args.buffer_mib)  # the limits' streaming read, beside the steps
    vocab, c = load_arch(args.model).vocab_size, args.batch_context
    per_size = len(threads) * (args.repeats + 1) * args.batch_steps + 2 * len(threads) + 2
    chunk = max(2048, c)  # tokens a step: the first prompts decode while the last prefill
    extra = len(sizes) * per_size + 4 + -(-sizes[0] * c // chunk)
    blocks = -(-(c + extra) // 16)
    config = EngineConfig(model=args.model, dtype=dtype, max_num_seqs=sizes[0],
                          max_model_len=c + extra, num_kv_blocks=sizes[0] * blocks + 4,
                          block_size=16, max_num_batched_tokens=chunk,
                          enable_prefix_caching=False)
    client = InprocClient(config)
    batch = _Batch(client, c)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=extra)
    out: dict[int, dict] = {}
    try:
        torch.set_num_threads(max(threads))  # the prefill is not timed: the fastest
        for i in range(sizes[0]):
            rid = f"bd{i}"
            client.add_request(EngineCoreRequest(rid, _prompt(vocab, c, 1000 + i), params, None))
            batch.tokens[rid] = c
        while any(n == c for n in batch.tokens.values()):
            batch.step()
        for size in sizes:
            drop = sorted(batch.tokens, key=batch.tokens.get, reverse=True)[:len(batch.tokens)
                                                                             - size]
            client.abort_requests(drop)
            for rid in drop:
                del batch.tokens[rid]
            out[size] = {}
            for t in threads:
                torch.set_num_threads(t)
                skinny_rows(getattr(torch, dtype))  # measured now if new, not in a timing
                batch.timed(2, size)
                best = min(batch.timed(args.batch_steps, size) for _ in range(args.repeats))
                read = read_gbps(kern, buf, t, 3) if kern else None
                matmul, attention = [0.0], [0.0]
                with python_layers(), _timed([layers, causal_lm], "linear", matmul), \
                        _timed([PagedAttention], "__call__", attention):
                    start = time.perf_counter()
                    batch.timed(args.batch_steps, size)
                    total = time.perf_counter() - start
                n = args.batch_steps
                out[size][t] = {"step_s": best[0], "context_sum": best[1],
                                "matmul_s": matmul[0] / n, "attention_s": attention[0] / n,
                                "profile_step_s": total / n,
                                "read_gbps": read}
    finally:
        client.shutdown()
    for size in sizes:
        for t in threads:
            out[size][t]["attention_alone"] = attention_alone(args, dtype, size, t)
    return out


def attention_alone(args: argparse.Namespace, dtype: str, batch: int, threads: int
                    ) -> dict[str, float] | None:
    """The paged decode kernel alone at batch B x --batch-context against a streaming read of
    the same bytes (module docstring); None without the compiled kernels."""
    import torch

    from engine.kernels import paged_attention
    from engine.models import load_arch
    from engine.runner.huge_pages import alloc_kv_cache

    k = paged_attention()
    if k is None:
        return None
    a, bs, c = load_arch(args.model), 16, args.batch_context
    blocks = -(-c // bs)
    gen = torch.Generator().manual_seed(batch)
    cache = alloc_kv_cache((batch * blocks, a.num_layers, 2, bs, a.num_kv_heads, a.head_dim),
                           getattr(torch, dtype))
    cache.copy_(torch.randn(cache.shape, generator=gen))
    view = cache.view(-1, bs, a.num_kv_heads, a.head_dim)
    table = torch.arange(batch * blocks).view(batch, blocks) * 2 * a.num_layers
    rows, ctx = torch.arange(batch), torch.full((batch,), c)
    q = torch.randn(batch, a.num_heads, a.head_dim, generator=gen)
    out = torch.empty_like(q)
    nbytes = cache.numel() * cache.element_size()
    buf = torch.ones(nbytes // 4)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    kern = read = float("inf")
    try:
        for _ in range(args.repeats + 1):  # the first of each warms
            start = time.perf_counter()
            for layer in range(a.num_layers):
                k.paged_decode(out, q, view, table, rows, ctx, layer, a.head_dim ** -0.5)
            kern = min(kern, time.perf_counter() - start)
            read = min(read, k.read_seconds(buf, threads))
    finally:
        torch.set_num_threads(old)
    return {"ms": round(kern * 1e3, 3), "kv_gbps": round(nbytes / kern / 1e9, 2),
            "read_gbps": round(nbytes / read / 1e9, 2), "read_fraction": round(read / kern, 3)}


def batch_table(args: argparse.Namespace, dtype: str, runs: dict[int, dict],
                limits: dict[str, Any], costs: dict[str, int]) -> dict[int, dict]:
    """Per B and thread count: step time, GB/s, the fraction of the streaming read, where the
    time went and the bound (module docstring)."""
    e = 4 if dtype == "float32" else 2
    weights = costs["linear_params"] + costs["head_params"]
    table: dict[int, dict] = {}
    for size, per_t in runs.items():
        table[size] = {}
        for t, r in per_t.items():
            lim = limits["threads"][t]
            read_gbps = read_against(lim, r.get("read_gbps"))
            kv_bytes = e * costs["kv_per_token"] * r["context_sum"]
            nbytes = e * weights + kv_bytes
            read_s = nbytes / (read_gbps * 1e9)
            peak = (lim["bf16_dot_gflops"] if e == 2 else None) or lim["fma_gflops"]
            matmul_floor = max(2.0 * size * weights / (peak * 1e9), e * weights / (read_gbps * 1e9))
            floor = matmul_floor + kv_bytes / (read_gbps * 1e9)
            gbps = nbytes / r["step_s"] / 1e9
            other = r["profile_step_s"] - r["matmul_s"] - r["attention_s"]
            table[size][t] = {
                "context": args.batch_context, "step_ms": round(r["step_s"] * 1e3, 3),
                "mean_context": round(r["context_sum"] / size, 1),
                "bytes_per_step": int(nbytes), "decode_gbps": round(gbps, 2),
                "read_gbps": round(read_gbps, 2),
                "decode_bandwidth_fraction": round(gbps / read_gbps, 3),
                "bound_fraction": round(min(1.0, read_s / floor), 3),
                "breakdown": {
                    "step_ms": round(r["profile_step_s"] * 1e3, 3),
                    "matmul_ms": round(r["matmul_s"] * 1e3, 3),
                    "matmul_gflops": round(2.0 * size * weights / r["matmul_s"] / 1e9, 2),
                    "attention_ms": round(r["attention_s"] * 1e3, 3),
                    "attention_kv_gbps": round(kv_bytes / r["attention_s"] / 1e9, 2),
                    "other_ms": round(other * 1e3, 3)},
                "attention_alone": r.get("attention_alone"),
            }
    return table


def print_table(dtype: str, table: dict[int, dict]) -> None:
    for size, per_t in table.items():
        for t, r in per_t.items():
            b = r["breakdown"]
            print(f"{dtype:8s} {t} thr  decode batch {size:3d} x {r['context']} ctx "
                  f"{r['step_ms']:8.2f} ms  {r['decode_gbps']:6.2f} GB/s = "
                  f"{r['decode_bandwidth_fraction']:.2f} of stream read "
                  f"{r['read_gbps']:.2f} (bound {r['bound_fraction']:.2f}; "
                  f"matmul {b['matmul_ms']:.2f} ms, attention {b['attention_ms']:.2f} ms at "
                  f"{b['attention_kv_gbps']:.1f} GB/s, other {b['other_ms']:.2f} ms)",
                  flush=True)
            alone = r.get("attention_alone")
            if alone:
                print(f"{dtype:8s} {t} thr  attention kernel alone batch {size:3d}: "
                      f"{alone['ms']:.2f} ms a step, KV at {alone['kv_gbps']:.2f} GB/s = "
                      f"{alone['read_fraction']:.2f} of a streaming read of the same bytes "
                      f"({alone['read_gbps']:.2f} GB/s)", flush=True)
