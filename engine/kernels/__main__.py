"""`python -m engine.kernels [--recalibrate]`: build (or find) the kernels and measure the
skinny_linear thresholds (and the other dispatch choices: the bf16 gemm's widening, bf16
prefill attention's layout on avx512_bf16); --recalibrate measures them again."""

from __future__ import annotations

import sys

import torch

from engine.kernels import cached_path, compiled
from engine.kernels.linear import bf16_attention_pairs, recalibrate, skinny_rows, widen_rows


def main(argv: list[str] | None = None) -> int:
    from engine.kernels.shm_comm import compiled_shm

    compiled_shm()  # the TP ranks' shared-memory collectives (a module of its own)
    mod = compiled()
    if mod is None:
        print(f"CPU kernels: NOT available ({cached_path()[1]})")
        return 1
    argv = sys.argv[1:] if argv is None else argv
    rows = (recalibrate() if "--recalibrate" in argv else
            {**{dt: skinny_rows(getattr(torch, dt)) for dt in ("float32", "bfloat16")},
             "bfloat16_widen": widen_rows(torch.get_num_threads())})
    if "--recalibrate" not in argv and mod.get_isa() == "avx512_bf16":
        rows["bfloat16_attention_pairs"] = int(bf16_attention_pairs())
    print(f"CPU kernels: ready, path {mod.get_isa()} of {', '.join(mod.isa_paths())} "
          f"({cached_path()[1]}); skinny_linear up to rows {rows}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
