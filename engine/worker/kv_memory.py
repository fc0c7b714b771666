"""KV cache allocation on transparent huge pages.

A NIXL WRITE or READ between processes on one host goes through UCX's cma transport
(process_vm_writev / process_vm_readv), which pins the remote pages of every transfer; pinning
one 2 MiB page instead of 512 small ones makes the copy itself the cost. Across hosts it
shortens the NIC's memory registration the same way. The cache is therefore allocated
2 MiB-aligned and advised MADV_HUGEPAGE before its first touch. Where the kernel has no THP
(or it is set to `never`) madvise fails quietly and the cache is ordinary memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def _madvise_hugepage(addr: int, length: int) -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return False
    return libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), _MADV_HUGEPAGE) == 0


def alloc_kv_cache(shape: tuple[int, ...], dtype: torch.dtype,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed tensor of `shape`; on the CPU, 2 MiB-aligned and backed by huge pages."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    region = raw[offset:offset + nbytes]
    if nbytes >= HUGE_PAGE:
        _madvise_hugepage(region.data_ptr(), nbytes - nbytes % HUGE_PAGE)
    cache = region.view(dtype).view(shape)
    cache.zero_()
    return cache
