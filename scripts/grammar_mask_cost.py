"""Per-step cost of a grammar engine's token mask on this CPU: xgrammar against llguidance.

One JSON-schema grammar over a model's tokenizer; per decode step: fill the next-token bitmask,
apply it to a float32 logits row, accept a token the mask allows. Reports microseconds per
step at batch 1 and 32 (matchers stepped one after another, as the runner does) and writes
bench/results/grammar_mask_cost.json. Usage: python scripts/grammar_mask_cost.py MODEL_DIR
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time

import torch
from transformers import AutoTokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}},
    "required": ["name", "age", "tags"]}
STEPS = 48


def _xgrammar(tok, vocab: int, batch: int) -> float:
    import xgrammar as xgr
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    ms = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    mask = xgr.allocate_token_bitmask(batch, vocab)
    logits = torch.randn(batch, vocab)
    t0 = time.perf_counter()
    for _ in range(STEPS):
        for i, m in enumerate(ms):
            m.fill_next_token_bitmask(mask, i)
        xgr.apply_token_bitmask_inplace(logits, mask)
        for i, m in enumerate(ms):
            tok_id = int(logits[i].argmax())
            if m.is_terminated() or not m.accept_token(tok_id):
                m.reset()
        logits.normal_()
    return (time.perf_counter() - t0) / STEPS * 1e6


def _llguidance(tok, vocab: int, batch: int) -> float:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt
    ltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    grm = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    ms = [llguidance.LLMatcher(ltok, grm) for _ in range(batch)]
    mask = lt.allocate_token_bitmask(batch, ltok.vocab_size)
    logits = torch.randn(batch, vocab)
    t0 = time.perf_counter()
    for _ in range(STEPS):
        for i, m in enumerate(ms):
            lt.fill_next_token_bitmask(m, mask, i)
        lt.apply_token_bitmask_inplace(logits, mask)
        for i, m in enumerate(ms):
            tok_id = int(logits[i].argmax())
            if m.is_stopped() or not m.consume_token(tok_id):
                m.reset()
        logits.normal_()
    return (time.perf_counter() - t0) / STEPS * 1e6


def main() -> None:
    model = sys.argv[1]
    tok = AutoTokenizer.from_pretrained(model)
    vocab = json.load(open(f"{model}/config.json"))["vocab_size"]
    rows = []
    for batch in (1, 32):
        for rnd in range(2):  # interleaved: each engine measured twice, alternating
            for name, fn in (("xgrammar", _xgrammar), ("llguidance", _llguidance)):
                rows.append({"engine": name, "batch": batch, "round": rnd,
                             "us_per_step": round(fn(tok, vocab, batch), 1)})
                print(rows[-1], flush=True)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines()
                       if ln.startswith("Model name")), platform.processor())
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    out = {"model": model, "vocab": vocab, "cpu": model_name, "load": load, "rows": rows}
    with open("bench/results/grammar_mask_cost.json", "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
