"""The import-linter contracts of pyproject.toml (docs/design.md §1) hold on this tree, and
they fail on a change that breaks them: a lazy import of a P/D package inside the engine, and
a cycle closed by an import inside a function (grimp counts both)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "kvconnector", "prefill", "decode", "proxy", "pdserve")
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(tree: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([str(LINT), str(tree / "pyproject.toml"), "--no-cache"],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture()
def tree(tmp_path: Path) -> Path:
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _append(path: Path, code: str) -> None:
    path.write_text(path.read_text() + "\n\n" + code + "\n")


def test_the_tree_keeps_every_contract(tree: Path) -> None:
    result = _lint(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout, result.stdout


def test_a_lazy_connector_import_and_a_lazy_cycle_break_the_contracts(tree: Path) -> None:
    # a connector named inside the engine, hidden in a function
    _append(tree / "engine" / "sched" / "scheduler.py",
            "def _leak():\n    from kvconnector.params import PREFILL_FLAG\n\n"
            "    return PREFILL_FLAG")
    # kernels sit below models: importing models from kernels, even lazily, closes a cycle
    # (models -> kernels -> models) and inverts the rooms' order
    _append(tree / "engine" / "kernels" / "linear.py",
            "def _up():\n    import engine.models.layers\n\n    return engine.models.layers")
    result = _lint(tree)
    out = result.stdout
    assert result.returncode != 0
    assert "The engine imports nothing of the P/D packages BROKEN" in out, out
    assert "engine.sched.scheduler -> kvconnector.params" in out, out
    assert "engine.kernels is not allowed to import engine.models" in out, out
    assert "No cycles are allowed in engine." in out and "- .kernels -> .models" in out, out
