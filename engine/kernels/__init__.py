"""Compiled CPU kernels, built once per machine with torch's C++ extension builder.

One extension module holds them all (bindings in ops.cpp): `paged_decode` (paged decode
attention, paged_attention.cpp), `prefill_attention` (causal prefill attention,
prefill_attention.cpp), `write_kv` (a step's K/V into the paged cache), `rope_` (rotary
embedding in place, rope.cpp), `add_rms_norm` (residual add + RMSNorm, rms_norm.cpp),
`silu_mul` (SwiGLU's activation, silu_mul.cpp) and `skinny_linear` (float32 / bf16
matmuls with few rows, skinny_linear.cpp), `argmax_rows` (greedy decoding's argmax,
argmax.cpp) and `DecodeStack` (a decode-only step's decoder
layers in compiled calls, decode_stack.cpp). `paged_attention()` and `linear_kernel()` return the
module or None, in which case the caller uses its pure-torch path. The build is keyed by the
sources, the compiler flags, the torch version and the CPU (the code is built with
-march=native) and cached as one shared object under $PDSERVE_KERNEL_CACHE (default
~/.cache/pdserve/kernels). A process that finds it imports it directly; one that does not
builds it in a private temporary directory and moves the result into place atomically, under
an flock beside it: concurrent starts (a P and a D, a test's engines) compile once, the others
wait and import the result, and a builder killed midway leaves no lock behind.
`make install` builds it ahead of time (`python -m engine.kernels`), so no engine start
pays for the compiler. PDSERVE_ATTENTION=torch and PDSERVE_LINEAR=torch turn the kernels off
(for comparisons and as escape hatches). The kernels run on the best instruction-set path the
build has (isa.h: avx512_bf16 > avx512 > avx2 > scalar); PDSERVE_ISA forces a lower one.
`roofline.cpp` holds the machine-limit loops of `pdserve bench roofline`.

The package sits below both the models and the runner and imports neither: `linear.py` is the
matmul dispatch the models' layers call (the skinny kernel, oneDNN or F.linear), `calibrate.py`
the measurements and their store that dispatch consults (it is handed the gemms it times),
`__main__.py` the ahead-of-time build.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name(n)
            for n in ("ops.cpp", "paged_attention.cpp", "prefill_attention.cpp", "rope.cpp",
                      "rms_norm.cpp", "silu_mul.cpp", "skinny_linear.cpp", "roofline.cpp",
                      "sgemm.cpp", "decode_stack.cpp", "argmax.cpp")]
_HEADERS = [Path(__file__).with_name(n) for n in ("isa.h", "simd.h")]


def _vendor_flags() -> list[str]:
    """-DPDSERVE_AMD_CPU on an AMD CPU (isa.h: how data read once is prefetched)."""
    try:
        with open("/proc/cpuinfo") as f:
            amd = any(ln.startswith("vendor_id") and "AuthenticAMD" in ln for ln in f)
    except OSError:
        amd = False
    return ["-DPDSERVE_AMD_CPU"] if amd else []


# -fopenmp: at::parallel_for is inlined into the kernel and parallel only with OpenMP on; the
# extension then shares torch's own libgomp.so.1 (the loader finds it already loaded).
_CFLAGS = ["-O3", "-march=native", "-fopenmp", *_vendor_flags()]


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = {ln for ln in f if ln.startswith(("model name", "flags"))}
        return "".join(sorted(lines))
    except OSError:
        return platform.processor()


def cached_path(prefix: str = "pdserve_kernels", sources: list[Path] | None = None,
                cflags: list[str] | None = None,
                headers: list[Path] | None = None) -> tuple[str, Path]:
    """(module name, shared object path) of this machine's build of `sources` (default: the
    main kernels), keyed by the sources, headers, flags, torch version and CPU."""
    import torch

    sources = _SOURCES if sources is None else sources
    headers = _HEADERS if headers is None else headers
    key = hashlib.sha256()
    for part in (*(src.read_bytes() for src in sources + headers),
                 " ".join(_CFLAGS if cflags is None else cflags).encode(),
                 torch.__version__.encode(), _cpu_id().encode()):
        key.update(part)
    name = f"{prefix}_{key.hexdigest()[:12]}"
    root = Path(os.environ.get("PDSERVE_KERNEL_CACHE",
                               Path.home() / ".cache" / "pdserve" / "kernels"))
    return name, root / f"{name}.so"


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(name: str, dest: Path, sources: list[Path], cflags: list[str]) -> None:
    from torch.utils.cpp_extension import load

    # The ninja wheel's binary sits beside the interpreter, whether or not the venv's bin
    # directory is on PATH.
    path = os.environ.get("PATH", "").split(os.pathsep)
    os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), *path])
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="build-", dir=dest.parent))
    ldflags = ["-fopenmp"] if "-fopenmp" in cflags else []
    try:
        load(name=name, sources=[str(src) for src in sources], extra_cflags=cflags,
             extra_ldflags=ldflags, build_directory=str(tmp), verbose=False)
        os.replace(tmp / f"{name}.so", dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _build_lock(dest: Path) -> Iterator[None]:
    """An exclusive flock beside the build: the kernel advises it and drops it when its holder
    exits, however it exits, so a builder killed midway leaves no lock behind."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.with_suffix(".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load_or_build(prefix: str, sources: list[Path], cflags: list[str],
                  headers: list[Path]) -> ModuleType:
    """The built module of `sources` (which include `headers`), built first (once, under the
    lock) if this machine has none yet. Raises what the build raises."""
    import torch  # noqa: F401  (the extension links against torch's libraries)

    name, path = cached_path(prefix, sources, cflags, headers)
    if not path.exists():
        with _build_lock(path):  # one builder per build; the others wait and import it
            if not path.exists():
                logger.info("building %s into %s", prefix, path)
                _build(name, path, sources, cflags)
    return _import(name, path)


@functools.cache
def compiled() -> ModuleType | None:
    """The kernels' module, built first if this machine has no build yet; None if it fails."""
    try:
        module = load_or_build("pdserve_kernels", _SOURCES, _CFLAGS, _HEADERS)
    except Exception as e:  # no compiler, no ninja, a build error: fall back, say why once
        first = str(e).splitlines()[0] if str(e) else ""
        logger.warning("compiled CPU kernels unavailable (%s: %s); using the torch paths",
                       type(e).__name__, first)
        return None
    _force_isa(module)
    return module


def _force_isa(module: ModuleType) -> None:
    """PDSERVE_ISA=scalar|avx2|avx512|avx512_bf16 runs the kernels on that path instead of the
    best this build has; a path the build lacks is an error naming the ones it has."""
    isa = os.environ.get("PDSERVE_ISA")
    if isa:
        try:
            module.set_isa(isa)
        except RuntimeError as e:
            raise ValueError(f"PDSERVE_ISA={isa}: {str(e).splitlines()[0]}") from None
        logger.info("CPU kernels forced onto the %s path", isa)


def paged_attention() -> ModuleType | None:
    """The module with `paged_decode`, unless PDSERVE_ATTENTION=torch."""
    if os.environ.get("PDSERVE_ATTENTION", "kernel") == "torch":
        return None
    return compiled()


def linear_kernel() -> ModuleType | None:
    """The module with `skinny_linear`, unless PDSERVE_LINEAR=torch."""
    if os.environ.get("PDSERVE_LINEAR", "kernel") == "torch":
        return None
    return compiled()
