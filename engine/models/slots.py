"""Where one checkpoint tensor lands in a model's parameters (`Slot`), shared by the weight
readers of every format (engine/models/weights.py, gguf_weights.py) and by the model families
that name their tensors (engine/models/families/)."""

from __future__ import annotations

import torch


class Slot:
    """Where one checkpoint tensor lands: dest[rows] (or dest[:, cols]) <- src[shard].

    With `shard_dim` set, the checkpoint tensor is `full_len` long along it and this rank
    takes [shard_start, shard_start + target length), cut short at full_len (the last
    vocabulary shard; its padding rows are zeroed).
    """

    __slots__ = ("dest", "dim", "start", "length", "shard_dim", "shard_start", "full_len")

    def __init__(self, dest: torch.Tensor, dim: int = 0, start: int = 0, length: int | None = None,
                 shard_dim: int | None = None, shard_start: int = 0,
                 full_len: int = 0) -> None:
        self.dest = dest
        self.dim = dim
        self.start = start
        self.length = dest.shape[dim] if length is None else length
        self.shard_dim = shard_dim
        self.shard_start = shard_start
        self.full_len = full_len

    def target(self) -> torch.Tensor:
        return self.dest.narrow(self.dim, self.start, self.length)

    def full_shape(self) -> list[int]:
        """The checkpoint tensor's expected shape."""
        shape = list(self.target().shape)
        if self.shard_dim is not None:
            shape[self.shard_dim] = self.full_len
        return shape

    def shard_bounds(self) -> tuple[int, int] | None:
        """[start, end) of this rank's part along shard_dim; None: take it whole."""
        if self.shard_dim is None:
            return None
        n = min(self.target().shape[self.shard_dim], self.full_len - self.shard_start)
        return self.shard_start, self.shard_start + n

    def write(self, src: torch.Tensor) -> None:
        """src: the checkpoint tensor already cut to shard_bounds()."""
        target = self.target()
        d = self.shard_dim
        with torch.no_grad():
            if d is not None and src.shape[d] < target.shape[d]:
                target.zero_()
                target = target.narrow(d, 0, src.shape[d])
            target.copy_(src)
