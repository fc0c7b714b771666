"""Shared fixtures: tiny models made once per test session."""

from __future__ import annotations

import os

# One intra-op thread per process: tests run many engine processes on two cores, and
# oversubscribed OpenMP spin-waits make everything crawl.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

ARCHS = ("llama", "qwen2", "qwen3")


def _make(root: str, arch: str, size: str = "tiny") -> str:
    from engine.models.tiny import make_tiny_model

    path = os.path.join(root, f"{size}-{arch}")
    if not os.path.exists(os.path.join(path, "config.json")):
        make_tiny_model(path, arch=arch, size=size, seed=0)
    return path


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tiny_model(model_root: str) -> str:
    """The tiny llama model every engine-level test uses."""
    return _make(model_root, "llama")


@pytest.fixture(scope="session")
def tiny_models(model_root: str) -> dict[str, str]:
    return {arch: _make(model_root, arch) for arch in ARCHS}


ISA_PATHS = ("avx512_bf16", "avx512", "avx2", "scalar")


@pytest.fixture(params=ISA_PATHS)
def kernel_isa(request: pytest.FixtureRequest):
    """The compiled kernels forced onto each instruction-set path in turn (as PDSERVE_ISA
    does); a path this CPU lacks is skipped (the build is -march=native, so it is not
    compiled in). Yields the kernels' module; the best path is restored afterwards. The
    skinny thresholds `linear` caches per dtype and thread count are dropped at each switch:
    they hold the path they were measured on."""
    from engine import kernels
    from engine.kernels import linear

    mod = kernels.compiled()
    # gcc and ninja are installed by `make install`: a missing kernel is a failure here.
    assert mod is not None, "the compiled CPU kernels did not build"
    if request.param not in mod.isa_paths():
        pytest.skip(f"this CPU has no {request.param} (its paths: {mod.isa_paths()})")
    best = mod.get_isa()
    mod.set_isa(request.param)
    linear._skinny.clear()
    try:
        yield mod
    finally:
        mod.set_isa(best)
        linear._skinny.clear()


# Modules that measure CPU time or look at machine-wide state (/dev/shm): `make test` runs the
# rest two at a time (pytest-xdist, one module per worker) and these afterwards, alone.
SERIAL_MODULES = {
    "tests/e2e/test_pd_first_token_push.py",  # D's CPU while legs wait for KV
    "tests/e2e/test_pd_push.py",  # idle engines' CPU
    "tests/e2e/test_pd_pull.py",  # idle engines' CPU
    "tests/integration/test_nixl_transport.py",  # a waiting agent's CPU
    "tests/faults/test_startup_deadlines.py",  # wall-clock bounds on exits
    "tests/unit/test_shm_broadcast.py",  # /dev/shm before and after
    "tests/unit/test_shm_collectives.py",  # /dev/shm segments
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = str(config.rootpath)
    for item in items:
        if os.path.relpath(str(item.path), root) in SERIAL_MODULES:
            item.add_marker(pytest.mark.serial)
