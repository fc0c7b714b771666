"""Tensor-parallel layout of one rank, and the vocab-parallel embedding and LM head.

Sharding (docs/design.md §8), rank r of T:
- attention: q heads [r*H/T, (r+1)*H/T); KV heads split the same way when KV >= T, else each
  KV head is replicated on T/KV consecutive ranks (rank r holds KV head r*KV//T), so every
  rank's q heads find their GQA head locally;
- MLP: gate/up column-parallel, down row-parallel; o_proj row-parallel; the row-parallel
  outputs are summed with `all_reduce`;
- vocabulary: rows [r*S, min(V, (r+1)*S)) of the embedding and LM head, S = ceil(V/T). The
  embedding looks up its own rows (zero elsewhere) and all-reduces; the LM head computes its
  slice of the logits and all-gathers them.
`check_tp` is the startup check: heads and MLP must split evenly (KV heads may replicate).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels.argmax import argmax_rows
from engine.models.arch import ModelArch

AllReduceFn = Callable[[torch.Tensor], torch.Tensor]
# all_gather(x [N, k]) -> [N, T*k]: every rank's x side by side, in rank order.
AllGatherFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Collectives:
    """The cross-rank operations a sharded model calls (torch.distributed in the workers)."""

    all_reduce: AllReduceFn
    all_gather: AllGatherFn


def check_tp(arch: ModelArch, tp_size: int) -> None:
    """Raise ValueError naming the field when `arch` cannot be split over `tp_size` ranks."""
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {tp_size}")
    for name in ("num_heads", "intermediate_size"):
        if getattr(arch, name) % tp_size:
            raise ValueError(f"{arch.architecture}: {name}={getattr(arch, name)} is not "
                             f"divisible by tensor_parallel_size={tp_size}")
    kv = arch.num_kv_heads
    if kv % tp_size and tp_size % kv:
        raise ValueError(f"{arch.architecture}: num_kv_heads={kv} neither divides nor is "
                         f"divisible by tensor_parallel_size={tp_size}")


@dataclass(frozen=True)
class TPLayout:
    """What rank `rank` of `size` holds."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    kv_head_start: int
    intermediate_size: int
    vocab_start: int
    vocab_rows: int  # rows this rank's shard has (the last rank's may be partly padding)
    vocab_size: int

    @classmethod
    def of(cls, arch: ModelArch, rank: int, size: int) -> TPLayout:
        check_tp(arch, size)
        if not 0 <= rank < size:
            raise ValueError(f"invalid tensor-parallel rank {rank} of {size}")
        kv = arch.num_kv_heads
        rows = -(-arch.vocab_size // size) if size > 1 else arch.vocab_size
        return cls(rank, size, arch.num_heads // size, max(1, kv // size), rank * kv // size,
                   arch.intermediate_size // size, rank * rows, rows, arch.vocab_size)

    @property
    def vocab_end(self) -> int:
        return min(self.vocab_size, self.vocab_start + self.vocab_rows)


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, layout: TPLayout,
                             comm: Collectives | None) -> torch.Tensor:
    if layout.size == 1:
        return F.embedding(ids, weight)
    mine = (ids >= layout.vocab_start) & (ids < layout.vocab_end)
    local = torch.where(mine, ids - layout.vocab_start, 0)
    x = F.embedding(local, weight) * mine.unsqueeze(-1).to(weight.dtype)
    return comm.all_reduce(x)


def gather_logits(local: torch.Tensor, layout: TPLayout,
                  comm: Collectives | None) -> torch.Tensor:
    """This rank's logit columns -> the full [N, vocab_size] logits on every rank."""
    if layout.size == 1:
        return local
    return comm.all_gather(local.contiguous())[:, :layout.vocab_size]


def gather_argmax(local: torch.Tensor, layout: TPLayout,
                  comm: Collectives | None) -> torch.Tensor:
    """Greedy decoding's tokens, int64 [N], from this rank's float32 logit columns, the
    argmax of `gather_logits` to the bit (the first maximum in vocabulary order; the first
    NaN). Under TP without gathering the logits: each rank takes its columns' argmax (value
    and vocabulary index), the ranks all-gather those [N, 2] pairs (float32: the index is
    exact below 2^24; a larger vocabulary gathers the logits) and every rank picks the first
    rank's pair holding the largest value."""
    if layout.size == 1 or layout.vocab_size >= 1 << 24:
        return argmax_rows(gather_logits(local, layout, comm))
    cols = layout.vocab_end - layout.vocab_start  # the last rank's padding columns left out
    if cols > 0:
        idx = argmax_rows(local[:, :cols])
        val = local.gather(1, idx[:, None])
    else:  # a rank past the vocabulary's end (more ranks than it has rows of logits)
        idx = torch.zeros(local.shape[0], dtype=torch.long, device=local.device)
        val = torch.full((local.shape[0], 1), float("-inf"), device=local.device)
    pair = torch.cat([val.float(), (idx + layout.vocab_start).float()[:, None]], dim=1)
    both = comm.all_gather(pair)  # [N, 2 * T]: rank r's value at 2r, its index at 2r + 1
    rank = argmax_rows(both[:, 0::2].contiguous())
    return both[:, 1::2].gather(1, rank[:, None]).squeeze(1).long()
