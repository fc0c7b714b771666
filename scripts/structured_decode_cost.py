"""Decode cost of constrained output against free decoding, at batch 1 and 32, one run.

In-process engine (no sockets), greedy, `--tokens` output tokens per request with
ignore_eos, on prompts of 8 tokens. Constrained rows follow a JSON schema whose string
values never have to end (so every step is masked): {"a": "<letters...>"}. Free and
constrained runs alternate (free, constrained, free, constrained) so machine load hits both;
each run's wall time / tokens is the per-step cost.
Writes bench/results/structured_decode_cost.json.
Usage: python scripts/structured_decode_cost.py MODEL_DIR [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

from engine.frontend.llm import LLM
from engine.protocol import SamplingParams, StructuredOutput

SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^[a-z]+$"}},
          "required": ["a"]}


def _run(llm: LLM, batch: int, tokens: int, constrained: bool) -> float:
    grammar = StructuredOutput("json", json.dumps(SCHEMA)) if constrained else None
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True,
                            structured=grammar)
    prompts = [[5 + i, 9, 13, 17, 21, 25, 29, 33] for i in range(batch)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
    return wall / tokens * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    llm = LLM(args.model, multiprocess=False, num_kv_blocks=1024, dtype="float32")
    _run(llm, 2, 4, True)  # compile the grammar and warm up outside the timings
    rows = []
    for batch in (1, 32):
        for rnd in range(2):
            for constrained in (False, True):
                ms = _run(llm, batch, args.tokens, constrained)
                rows.append({"batch": batch, "round": rnd, "constrained": constrained,
                             "ms_per_step": round(ms, 3)})
                print(rows[-1], flush=True)
    ratios = {}
    for batch in (1, 32):
        free = sum(r["ms_per_step"] for r in rows if r["batch"] == batch
                   and not r["constrained"])
        cons = sum(r["ms_per_step"] for r in rows if r["batch"] == batch and r["constrained"])
        ratios[f"batch{batch}"] = round(cons / free, 3)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines()
                 if ln.startswith("Model name")), "")
    out = {"model": args.model, "tokens": args.tokens, "cpu": name, "rows": rows,
           "constrained_over_free": ratios,
           "load": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}
    print(out["constrained_over_free"], out["load"])
    with open("bench/results/structured_decode_cost.json", "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
