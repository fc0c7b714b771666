"""The model families, by name and by the architecture names that select them.

One module per family (llama.py, qwen2.py, qwen3.py), each exporting `FAMILY`, a `Family`
(families/base.py): its config.json mapping, its tensor names and their tensor-parallel
shards, the module it builds, and its GGUF names where it has any. Adding a family is one new
module and one line in FAMILIES.
"""

from __future__ import annotations

from engine.models.families import llama, qwen2, qwen3
from engine.models.families.base import Family

FAMILIES: dict[str, Family] = {f.name: f for f in (llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY)}
BY_ARCHITECTURE: dict[str, Family] = {a: f for f in FAMILIES.values() for a in f.architectures}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(BY_ARCHITECTURE)
SUPPORTED_GGUF_ARCHITECTURES: tuple[str, ...] = tuple(
    f.gguf_architecture for f in FAMILIES.values() if f.gguf_architecture)


def family_of(architecture: str) -> Family:
    """The family serving a config.json architecture name; ValueError naming the supported."""
    if architecture not in BY_ARCHITECTURE:
        raise ValueError(f"unsupported architecture {architecture!r} "
                         f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    return BY_ARCHITECTURE[architecture]


def gguf_family(gguf_architecture: str) -> Family | None:
    """The family serving a GGUF `general.architecture`; None when no family does."""
    return next((f for f in FAMILIES.values() if f.gguf_architecture == gguf_architecture), None)


__all__ = ["FAMILIES", "Family", "SUPPORTED_ARCHITECTURES", "SUPPORTED_GGUF_ARCHITECTURES",
           "family_of", "gguf_family"]
