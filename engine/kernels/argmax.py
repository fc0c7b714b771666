"""Greedy decoding's argmax over a step's logits: the compiled `argmax_rows` (argmax.cpp,
vectorized; torch.argmax's answer on every input, NaN included) where the kernels are built,
else torch.argmax."""

from __future__ import annotations

import torch

from engine.kernels import compiled


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] logits -> int64 [N], the index of each row's maximum (the first one; the first
    NaN where a row has one), as torch.argmax(logits, dim=-1)."""
    mod = compiled()
    if (mod is None or logits.dtype != torch.float32 or logits.dim() != 2
            or logits.device.type != "cpu" or logits.shape[1] == 0):
        return logits.argmax(dim=-1)
    return mod.argmax_rows(logits.contiguous())
