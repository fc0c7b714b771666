"""The TP ranks' collectives: a shared-memory all-reduce / all-gather on one host's CPU ranks,
gloo (torch.distributed) for everything else (docs/design.md §8).

The TP layers sum their row-parallel outputs twice per layer and step; over gloo that is TCP
on loopback, which made TP=2 slower than one 2-thread process. On CPU the ranks of a group
(always one host: the executor spawns them) instead meet in one shared segment:

- the executor creates it (`create_segment`) before spawning the ranks: a file made with
  mkstemp (mode 0600, O_EXCL, an unpredictable name) in /dev/shm, or in its private 0700
  directory when /dev/shm is unusable, with its pages reserved up front (posix_fallocate: a
  full tmpfs is an error at start-up, never a SIGBUS mid-step); it unlinks the file once every
  rank reported ready (each has it mapped by then) and again at shutdown. Nothing listens;
  no other user can open it.
- each rank maps it (`make_collectives`; `ShmComm` of engine/kernels/shm_comm.cpp):
  per round a rank copies its part into its slot, publishes its round counter and waits for
  every peer's (a short spin, then asleep on a futex the peer's arrival wakes); sums run in
  rank order on every rank, so every rank holds the bit-identical result. A peer whose
  process is gone, or that has not arrived after `step_timeout_s`, makes the wait raise: the
  worker's RPC fails, the worker exits, and the executor's rank-death handling fails the
  engine.

float32 and bfloat16 contiguous CPU tensors take the shared path; anything else (and CUDA,
where nccl runs) goes to gloo, as does everything when PDSERVE_TP_COMM=gloo, when the compiled
kernels are unavailable, or when any rank could not attach (the ranks agree over gloo at
start-up, so they never disagree on the path).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile

import torch
import torch.distributed as dist

from engine.models.parallel import Collectives

logger = logging.getLogger(__name__)

ENV = "PDSERVE_TP_COMM"  # "shm" (default) or "gloo"
SLOT_BYTES = 2 << 20  # per rank and parity; larger tensors go through in several rounds
_HEADER_BYTES = 4096
_SHM_DIR = "/dev/shm"
_DTYPES = (torch.float32, torch.bfloat16)


def segment_bytes(tp_size: int, slot_bytes: int = SLOT_BYTES) -> int:
    return _HEADER_BYTES + 2 * tp_size * slot_bytes


def wanted() -> bool:
    mode = os.environ.get(ENV, "shm")
    if mode not in ("shm", "gloo"):
        raise ValueError(f"{ENV}={mode!r}: expected 'shm' or 'gloo'")
    return mode == "shm"


def create_segment(private_dir: str, tp_size: int, slot_bytes: int = SLOT_BYTES) -> str | None:
    """Executor side: the segment's path, or None (the ranks use gloo) when shm is turned off
    or cannot be made (said in the log)."""
    if not wanted():
        return None
    usable = os.path.isdir(_SHM_DIR) and os.access(_SHM_DIR, os.W_OK | os.X_OK)
    fd, path = tempfile.mkstemp(prefix="pdserve-tp-comm-", dir=_SHM_DIR if usable
                                else private_dir)
    try:
        os.posix_fallocate(fd, 0, segment_bytes(tp_size, slot_bytes))
    except OSError as e:
        os.close(fd)
        remove_segment(path)
        logger.warning("tensor parallel: cannot reserve %d bytes for the shared-memory "
                       "collectives in %s (%s); using gloo", segment_bytes(tp_size, slot_bytes),
                       os.path.dirname(path), e)
        return None
    os.close(fd)
    return path


def remove_segment(path: str | None) -> None:
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def gloo_all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum over the TP group, in place (gloo on CPU, nccl on CUDA)."""
    dist.all_reduce(t)
    return t


def gloo_all_gather(t: torch.Tensor) -> torch.Tensor:
    """[N, k] on each rank -> [N, T*k], ranks side by side."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return torch.cat(parts, dim=-1)


GLOO = Collectives(gloo_all_reduce, gloo_all_gather)


class ShmCollectives:
    """all_reduce / all_gather over the shared segment, gloo for what it does not take."""

    def __init__(self, comm) -> None:  # comm: the kernels' ShmComm
        self.comm = comm

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if t.dtype in _DTYPES and t.is_contiguous() and t.device.type == "cpu":
            self.comm.all_reduce(t)
            return t
        return gloo_all_reduce(t)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        if (t.dtype in _DTYPES and t.dim() == 2 and t.is_contiguous()
                and t.device.type == "cpu" and t.shape[1] * t.element_size() <= SLOT_BYTES):
            return self.comm.all_gather(t)
        return gloo_all_gather(t)

    def collectives(self) -> Collectives:
        return Collectives(self.all_reduce, self.all_gather)


def _attach(path: str | None, rank: int, tp_size: int, timeout_s: float):
    if path is None:
        return None
    from engine.kernels.shm_comm import compiled_shm

    mod = compiled_shm()
    if mod is None:
        return None
    try:
        return mod.ShmComm(path, rank, tp_size, SLOT_BYTES, timeout_s)
    except RuntimeError as e:
        logger.warning("tensor-parallel rank %d: cannot map %s (%s)", rank, path, e)
        return None


def make_collectives(path: str | None, rank: int, tp_size: int,
                     timeout_s: float) -> tuple[Collectives, str]:
    """Worker side, after the gloo group is up: (the collectives, "shm" or "gloo"). Every rank
    must call it (it agrees with the others over gloo)."""
    comm = _attach(path, rank, tp_size, timeout_s)
    ok = torch.tensor([0 if comm is None else 1], dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # one rank without the segment: all use gloo
    if not ok.item():
        if path is not None:
            logger.warning("tensor-parallel rank %d: shared-memory collectives unavailable on "
                           "some rank; using gloo", rank)
        return GLOO, "gloo"
    return ShmCollectives(comm).collectives(), "shm"
