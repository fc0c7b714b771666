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
