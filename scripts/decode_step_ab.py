"""One decode step at batch B x 1024 context, split by kernel, on a given build of the kernels.

Prefills B random 1024-token prompts (bench-llama, prefix caching off), then times `steps`
full-batch decode steps and the compiled kernels' calls inside them (every call of the
module wrapped in a timer): the rest of the step is the Python around them.

usage: [KHASH=<build hash>] python scripts/decode_step_ab.py DTYPE B THREADS [STEPS]
KHASH picks a build under ~/.cache/pdserve/kernels/pdserve_kernels_<hash>.so (an older
commit's build: run the same command with two hashes, alternating, for an A/B).
"""

from __future__ import annotations

import collections
import os
import random
import sys
import time

import torch
from decode_kernels_ab import load  # the same directory: a build by its hash

import engine.kernels as ek
import engine.kernels.linear as el
from pdserve.bench.offline import python_layers


class _Timed:
    """The kernels' module with every call timed into `spent` / `calls`."""

    def __init__(self, module) -> None:
        self.module = module
        self.spent: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter = collections.Counter()

    def __getattr__(self, name: str):
        fn = getattr(self.module, name)
        if not callable(fn) or name == "get_isa":
            return fn

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.spent[name] += time.perf_counter() - start
            self.calls[name] += 1
            return out
        return timed


def use_kernels(kernels):
    """Every caller of the compiled kernels (linear, the attention, the DecodeStack) gets
    `kernels` (a build by its hash, or a wrapper) instead of this tree's build."""
    for mod in (ek, el):
        mod.compiled = lambda: kernels
        mod.linear_kernel = lambda: kernels
    ek.paged_attention = lambda: kernels
    return kernels


def prefilled(dtype: str, batch: int, steps: int, ctx: int = 1024,
              model: str = ".models/bench-llama"):
    """An in-process engine (`model`, prefix caching off) running `batch` random
    `ctx`-token prompts, prefilled and two full decode steps in, with room for `steps` more."""
    from engine.client.inproc import InprocClient
    from engine.config import EngineConfig
    from engine.models import load_arch
    from engine.protocol import EngineCoreRequest, SamplingParams

    # the first prompts decode while the last prefill: room for their extra tokens
    extra = steps + 8 + batch * ctx // 2048
    config = EngineConfig(model=model, dtype=dtype, max_num_seqs=batch,
                          max_model_len=ctx + extra + 16,
                          num_kv_blocks=batch * ((ctx + extra + 16) // 16 + 1) + 4,
                          block_size=16, max_num_batched_tokens=2048,
                          enable_prefix_caching=False)
    client = InprocClient(config)
    rng = random.Random(0)
    vocab = load_arch(model).vocab_size
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=extra)
    for i in range(batch):
        prompt = [rng.randrange(10, vocab) for _ in range(ctx)]
        client.add_request(EngineCoreRequest(f"r{i}", prompt, params, None))
    full = 0
    while full < 3:  # the prefills, then two full steps
        full += len(client.get_output().outputs) == batch
    return client


def main() -> None:
    dtype, batch, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 20
    key = os.environ.get("KHASH")
    kernels = use_kernels(_Timed(load(key) if key else ek.compiled()))
    torch.set_num_threads(threads)
    client = prefilled(dtype, batch, steps)
    kernels.spent.clear()
    kernels.calls.clear()
    # the split needs the layers' calls from Python (decode_stack_ab.py: the stack's A/B)
    with python_layers():
        start = time.perf_counter()
        for _ in range(steps):
            client.get_output()
        step = (time.perf_counter() - start) / steps
    print(f"{dtype} B={batch} threads={threads} step {step * 1e3:.2f} ms", end="")
    for name, spent in sorted(kernels.spent.items(), key=lambda kv: -kv[1]):
        print(f"  {name} {spent / steps * 1e3:.2f}", end="")
    print(f"  other {(step - sum(kernels.spent.values()) / steps) * 1e3:.2f}")
    client.shutdown()


if __name__ == "__main__":
    main()
