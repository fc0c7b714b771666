"""The bf16 referee: our greedy bf16 tokens judged step by step by transformers' own bf16
logits on *our* prefix, on each instruction-set path this CPU has.

Two bf16 engines round every matmul output to bf16 but sum in different orders, so where
two candidates sit within bf16 rounding of each other either may win (an exact tie in
transformers' logits is common: the tiny models' logits lie at |8..16|, where bf16 numbers
are 1/16 apart). Demanding an equal prefix or identical answers bets on which way the ties
of this CPU's arithmetic fall. Instead transformers is run once, teacher-forced on the
prompt plus our tokens, and at every step our token must be its argmax or within
BF16_TIE_ULPS bf16 steps of it (a tie the numerics allow); after a tie the comparison goes
on from our own prefix, so every step is judged and none is skipped.

The tolerance. A bf16 logit carries 8 significant bits: numbers near |x| are
bf16_ulp(x) = 2**(floor(log2|x|) - 7) apart. The errors that separate two arithmetics are
absolute errors on the scale of the whole logit row (rounded hidden states times the
lm_head rows), so the unit is the ulp of the row's largest |logit|, u. If our pick a beats
transformers' pick b in our logits, then in transformers' logits
  T(b) - T(a) <= |T(b) - O(b)| + |O(a) - T(a)|,
and each |T - O| is two final roundings (1/2 u each side) plus what the two arithmetics'
summation orders and intermediate bf16 roundings left apart before them. Two steps (the
final roundings) plus one for the propagated difference: BF16_TIE_ULPS = 3. Measured
(AMD EPYC, AVX2; avx2 and scalar kernel paths, 1 and 2 threads): the tiny models' largest
gap is 2 u (17 prompts x 32 tokens x 3 archs), SmolLM2's GGUF 3 u. A real bug is far
outside: skinny rows that drop their last 8 inputs (an AVX2 tail bug) give 60-150 u, and
every bf16 matmul output scaled by 1 + 2**-8 (a sub-ulp bias) already 4-5 u on qwen2/qwen3.
Sub-ulp kernel errors are the kernel tests' job (tests/unit: every ISA path against
float64); this test judges the whole engine.

ISA paths. The kernels run the best path this CPU has unless PDSERVE_ISA forces a lower one,
and oneDNN (bf16 prefill matmuls) and torch pick theirs from ONEDNN_MAX_CPU_ISA and
ATEN_CPU_CAPABILITY, both read once per process. A test parametrized over REFEREE_PATHS
runs the best path in process; a lower path this CPU has runs the same test in a child
pytest with all three set, so an AVX-512 machine also runs what an AVX2-only one runs.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

BF16_TIE_ULPS = 3
MIN_ARGMAX_SHARE = 0.9  # most steps are transformers' argmax exactly (measured: >= 0.97)
REFEREE_PATHS = ("best", "avx512", "avx2")
_ONEDNN_ISA = {"avx512": "AVX512_CORE", "avx2": "AVX2"}
_CHILD = "PDSERVE_REFEREE_PATH"  # set in the child pytest: the path it runs in process


def bf16_ulp(x: float) -> float:
    """The distance between neighbouring bf16 numbers at |x| (8 significant bits)."""
    x = abs(float(x))
    return 2.0 ** (math.floor(math.log2(x)) - 7) if x > 0 else 2.0 ** -133


def runs_here(isa: str, request: pytest.FixtureRequest, tmp_path: Path) -> bool:
    """For a test parametrized over REFEREE_PATHS: True where its body runs in this process
    (the best path, or the child on a lower one). Otherwise runs the test in a child pytest on
    that path, asserts it passed, prints its report and returns False; skips a path this CPU
    lacks or the one this process already runs."""
    from engine import kernels

    mod = kernels.compiled()
    assert mod is not None, "the compiled CPU kernels did not build"
    if isa == "best" or os.environ.get(_CHILD) == isa:
        assert isa == "best" or mod.get_isa() == isa, (isa, mod.get_isa())
        return True
    if isa not in mod.isa_paths():
        pytest.skip(f"this CPU has no {isa} path (its paths: {mod.isa_paths()})")
    if mod.get_isa() == isa:
        pytest.skip(f"{isa} is the path this process runs: the [best] case covers it")
    env = {**os.environ, _CHILD: isa, "PDSERVE_ISA": isa, "ONEDNN_MAX_CPU_ISA": _ONEDNN_ISA[isa],
           "ATEN_CPU_CAPABILITY": isa}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
         f"--basetemp={tmp_path / 'child'}", request.node.nodeid],
        cwd=request.config.rootpath, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    passed = re.search(r"^1 passed", proc.stdout, re.M) is not None
    assert proc.returncode == 0 and passed, f"on the {isa} path:\n{out[-6000:]}"
    print("\n".join(line for line in proc.stdout.splitlines() if "bf16" in line))
    return False


def judge(model, prompts: Sequence[list[int]], ours: Sequence[list[int]], label: str,
          tie_ulps: float = BF16_TIE_ULPS) -> str:
    """Asserts every one of our tokens is transformers' argmax on our prefix, or within
    `tie_ulps` bf16 steps of it; returns a one-line report. `model`: transformers' bf16."""
    ties, steps, exact = [], 0, 0
    for i, logits in enumerate(teacher_forced_logits(model, prompts, ours)):
        for j, token in enumerate(ours[i]):
            row = logits[j]
            gap = float(row.max() - row[token])
            ulps = gap / bf16_ulp(float(row.abs().max()))
            steps += 1
            exact += gap == 0
            if gap > 0:
                ties.append((i, j, round(gap, 4), round(ulps, 2)))
            assert ulps <= tie_ulps, (
                f"{label}: prompt {i} token {j}: ours {token} is {gap:.4f} ({ulps:.1f} bf16 "
                f"steps) below transformers' argmax {int(row.argmax())} on our prefix; "
                f"ties so far (prompt, token, gap, steps): {ties}")
    assert exact >= MIN_ARGMAX_SHARE * steps, f"{label}: {exact}/{steps} argmax; {ties}"
    return (f"{label} bf16: {exact}/{steps} steps transformers' argmax, the rest ties "
            f"(prompt, token, gap, bf16 steps): {ties}")


def teacher_forced_logits(model, prompts: Sequence[list[int]], ours: Sequence[list[int]],
                          batch: int = 4) -> list[torch.Tensor]:
    """transformers' logits for each of our tokens given the prompt and our tokens before it
    (float32 copies of its bf16 logits); right-padded batches, so positions are unshifted."""
    out: list[torch.Tensor] = []
    with torch.inference_mode():
        for start in range(0, len(prompts), batch):
            seqs = [p + o for p, o in zip(prompts[start:start + batch],
                                          ours[start:start + batch], strict=True)]
            width = max(map(len, seqs))
            ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
            mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
            logits = model(input_ids=ids, attention_mask=mask).logits
            for row, (p, o) in enumerate(zip(prompts[start:start + batch],
                                             ours[start:start + batch], strict=True)):
                out.append(logits[row, len(p) - 1:len(p) - 1 + len(o)].float())
    return out
