"""The shared-memory collectives' kernel (shm_comm.cpp: `ShmComm`), an extension module of its
own beside the main kernels (engine/kernels/__init__.py): the same builder (`load_or_build`:
cache directory, key scheme, build lock, atomic move into place), keyed by its one source, so
a change to either never rebuilds the other. `python -m engine.kernels` builds it ahead of
time; `compiled_shm()` returns the module, or None (the TP ranks then use gloo)."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

from engine.kernels import load_or_build

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name("shm_comm.cpp")]
_CFLAGS = ["-O3", "-march=native"]


@functools.cache
def compiled_shm() -> ModuleType | None:
    """The module with `ShmComm`, built first if this machine has none; None if that fails."""
    try:
        return load_or_build("pdserve_shm_comm", _SOURCES, _CFLAGS, headers=[])
    except Exception as e:  # no compiler, a build error: the ranks use gloo; say why once
        first = str(e).splitlines()[0] if str(e) else ""
        logger.warning("shared-memory collectives kernel unavailable (%s: %s); the TP ranks "
                       "use gloo", type(e).__name__, first)
        return None
