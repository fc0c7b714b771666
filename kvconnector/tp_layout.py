"""Where a tensor-parallel rank's KV heads lie inside its blocks, and the descriptors that
move one head range between engines of different TP sizes (docs/design.md §8).

A rank's KV cache is ``[blocks, layers, 2, block_size, heads, head_dim]``: within a block, the
model's KV heads ``[h0, h0 + n)`` (inside the rank's own ``[first_head, first_head + heads)``)
are ``layers·2·block_size`` runs of ``n·head_dim·itemsize`` bytes, run ``(l, kv, t)`` at byte
``((l·2 + kv)·block_size + t)·heads·head_dim·itemsize + (h0 - first_head)·head_dim·itemsize``.
A rank writing its heads into a peer that holds more (or fewer) of them pairs its runs with
the peer's runs of the same heads; when both hold exactly the heads moved, a block is one
contiguous range and one descriptor covers it.

Pure functions over plain data: nothing here touches NIXL or a thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class HeadLayout:
    """One rank's block: model KV heads ``[first_head, first_head + heads)`` of
    ``total_heads``, ``layers·2·block_size`` rows of ``heads·head_dim`` items."""

    num_layers: int
    block_size: int
    heads: int
    first_head: int
    total_heads: int
    head_dim: int
    itemsize: int

    @property
    def runs_per_block(self) -> int:
        return self.num_layers * 2 * self.block_size

    @property
    def head_bytes(self) -> int:
        return self.head_dim * self.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.runs_per_block * self.heads * self.head_bytes

    def run_offsets(self, h0: int, n: int) -> np.ndarray:
        """Byte offsets inside a block of the runs holding model heads ``[h0, h0 + n)``."""
        if not (self.first_head <= h0 and h0 + n <= self.first_head + self.heads and n > 0):
            raise ValueError(f"heads [{h0}, {h0 + n}) are not all in this rank's "
                             f"[{self.first_head}, {self.first_head + self.heads})")
        row = self.heads * self.head_bytes
        return (np.arange(self.runs_per_block, dtype=np.uint64) * np.uint64(row)
                + np.uint64((h0 - self.first_head) * self.head_bytes))


def rank_layout(spec: Any, total_heads: int, rank: int, size: int) -> HeadLayout:
    """Rank `rank` of `size`'s layout for an engine's `KVCacheSpec` (heads: the rank's); its
    first head as the model shards it (models/parallel.TPLayout: replicated when fewer KV heads
    than ranks)."""
    per_block = spec.num_layers * 2 * spec.block_size * spec.num_kv_heads * spec.head_dim
    return HeadLayout(spec.num_layers, spec.block_size, spec.num_kv_heads,
                      rank * total_heads // size, total_heads, spec.head_dim,
                      spec.bytes_per_block // per_block)


def overlap(a: HeadLayout, b: HeadLayout) -> tuple[int, int] | None:
    """The model heads both ranks hold, as (first, count), or None."""
    lo = max(a.first_head, b.first_head)
    hi = min(a.first_head + a.heads, b.first_head + b.heads)
    return (lo, hi - lo) if hi > lo else None


def peer_ranks(rank: int, size: int, peer_size: int) -> list[int]:
    """The ranks of a `peer_size` engine holding heads that rank `rank` of `size` holds, when
    the model's KV heads divide by both sizes (rank r holds the fraction [r/size, (r+1)/size))."""
    return [p for p in range(peer_size)
            if p * size < (rank + 1) * peer_size and rank * peer_size < (p + 1) * size]


def transfer_descs(local: HeadLayout, local_base: int, local_ids: np.ndarray, local_dev: int,
                   remote: HeadLayout, remote_base: int, remote_ids: np.ndarray,
                   remote_dev: int) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) ``[N, 3]`` descriptor arrays (address, length, device) moving the
    heads both hold from local blocks ``local_ids[i]`` into remote blocks ``remote_ids[i]``.
    One descriptor per block when both hold exactly those heads, else one per run."""
    common = overlap(local, remote)
    if common is None:
        raise ValueError(f"no KV heads in common: local [{local.first_head}, "
                         f"{local.first_head + local.heads}), remote [{remote.first_head}, "
                         f"{remote.first_head + remote.heads})")
    h0, n = common
    if n == local.heads == remote.heads:  # whole blocks on both sides
        loc_off = rem_off = np.zeros(1, dtype=np.uint64)
        length = local.bytes_per_block
    else:
        loc_off, rem_off = local.run_offsets(h0, n), remote.run_offsets(h0, n)
        length = n * local.head_bytes
    return (_descs(local_base, local.bytes_per_block, local_ids, loc_off, length, local_dev),
            _descs(remote_base, remote.bytes_per_block, remote_ids, rem_off, length,
                   remote_dev))


def _descs(base: int, bytes_per_block: int, ids: np.ndarray, offsets: np.ndarray,
           length: int, device: int) -> np.ndarray:
    starts = (np.uint64(base) + np.asarray(ids, dtype=np.uint64)[:, None]
              * np.uint64(bytes_per_block) + offsets[None, :]).reshape(-1)
    out = np.empty((starts.size, 3), dtype=np.uint64)
    out[:, 0], out[:, 1], out[:, 2] = starts, length, device
    return out
