"""The shared-memory collectives' kernel (shm_comm.cpp: `ShmComm`), an extension module of its
own beside the main kernels (engine/kernels/__init__.py): the same builder, cache directory,
key scheme and atomic move into place, keyed by its one source, so a change to either never
rebuilds the other. `python -m engine.kernels` builds it ahead of time; `compiled_shm()`
returns the module, or None (the TP ranks then use gloo)."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType

from engine.kernels import _cpu_id, _import

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("shm_comm.cpp")
_CFLAGS = ["-O3", "-march=native"]


def cached_path() -> tuple[str, Path]:
    import torch

    key = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), " ".join(_CFLAGS).encode(), torch.__version__.encode(),
                 _cpu_id().encode()):
        key.update(part)
    name = f"pdserve_shm_comm_{key.hexdigest()[:12]}"
    root = Path(os.environ.get("PDSERVE_KERNEL_CACHE",
                               Path.home() / ".cache" / "pdserve" / "kernels"))
    return name, root / f"{name}.so"


def _build(name: str, dest: Path) -> None:
    from torch.utils.cpp_extension import load

    path = os.environ.get("PATH", "").split(os.pathsep)
    os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), *path])
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="build-", dir=dest.parent))
    try:
        load(name=name, sources=[str(_SOURCE)], extra_cflags=_CFLAGS,
             build_directory=str(tmp), verbose=False)
        os.replace(tmp / f"{name}.so", dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@functools.cache
def compiled_shm() -> ModuleType | None:
    """The module with `ShmComm`, built first if this machine has none; None if that fails."""
    try:
        import torch  # noqa: F401  (the extension links against torch's libraries)

        name, path = cached_path()
        if not path.exists():
            logger.info("building the shared-memory collectives kernel into %s", path)
            _build(name, path)
        return _import(name, path)
    except Exception as e:  # no compiler, a build error: the ranks use gloo; say why once
        first = str(e).splitlines()[0] if str(e) else ""
        logger.warning("shared-memory collectives kernel unavailable (%s: %s); the TP ranks "
                       "use gloo", type(e).__name__, first)
        return None
