"""The model's matmuls: `linear(x, w, b)` is F.linear, except for a few rows on the CPU.

A decode step with a small batch multiplies a few rows by every weight matrix; the time is
the weight's trip from memory, and MKL's sgemm (behind F.linear) spends up to twice that. For
float32 CPU inputs of at most SKINNY_ROWS_PER_THREAD rows per torch thread the compiled
`skinny_linear` kernel (engine/worker/kernels/skinny_linear.cpp) streams the weight once
instead: 0.6-0.9 of MKL's time for 2-32 rows on one thread, 0.35-0.9 for 2-64 rows on two
(`pdserve bench linear`, bench model). Beyond that MKL's blocking wins.
PDSERVE_LINEAR=torch keeps F.linear everywhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.worker.kernels import linear_kernel

SKINNY_ROWS_PER_THREAD = 32


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] @ weight[out, in]^T + bias, as F.linear."""
    if (x.dim() == 2 and x.shape[0] <= SKINNY_ROWS_PER_THREAD * torch.get_num_threads()
            and x.dtype == torch.float32
            and weight.dtype == torch.float32 and x.device.type == "cpu"):
        kernel = linear_kernel()
        if kernel is not None:
            y = kernel.skinny_linear(x.contiguous(), weight.contiguous())
            return y if bias is None else y.add_(bias)
    return F.linear(x, weight, bias)
