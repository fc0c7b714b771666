"""The model families, by name and by the architecture names that select them.

One module per family (llama.py, qwen2.py, qwen3.py), each exporting `FAMILY`, a `Family`
(families/base.py): its config.json mapping, its tensor names and their tensor-parallel
shards, the module it builds, and its GGUF names where it has any. Adding a family is one new
module and one line in BUILTIN (or a `register(FAMILY)` call, e.g. from a plugin or a test).
"""

from __future__ import annotations

from engine.models.families import llama, qwen2, qwen3
from engine.models.families.base import Family

BUILTIN: tuple[Family, ...] = (llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY)
FAMILIES: dict[str, Family] = {}
BY_ARCHITECTURE: dict[str, Family] = {}


def register(family: Family) -> None:
    """Serve `family`'s architectures; a name or architecture already taken is a ValueError."""
    taken = [a for a in family.architectures if a in BY_ARCHITECTURE]
    if family.name in FAMILIES or taken:
        raise ValueError(f"model family {family.name!r} clashes with a registered one "
                         f"(architectures taken: {taken})")
    FAMILIES[family.name] = family
    BY_ARCHITECTURE.update(dict.fromkeys(family.architectures, family))


def unregister(name: str) -> None:
    family = FAMILIES.pop(name)
    for a in family.architectures:
        BY_ARCHITECTURE.pop(a, None)


for _family in BUILTIN:
    register(_family)


def supported_architectures() -> tuple[str, ...]:
    return tuple(BY_ARCHITECTURE)


def supported_gguf_architectures() -> tuple[str, ...]:
    return tuple(f.gguf_architecture for f in FAMILIES.values() if f.gguf_architecture)


def family_of(architecture: str) -> Family:
    """The family serving a config.json architecture name; ValueError naming the supported."""
    if architecture not in BY_ARCHITECTURE:
        raise ValueError(f"unsupported architecture {architecture!r} "
                         f"(supported: {', '.join(supported_architectures())})")
    return BY_ARCHITECTURE[architecture]


def gguf_family(gguf_architecture: str) -> Family | None:
    """The family serving a GGUF `general.architecture`; None when no family does."""
    return next((f for f in FAMILIES.values() if f.gguf_architecture == gguf_architecture), None)


__all__ = ["FAMILIES", "Family", "family_of", "gguf_family", "register",
           "supported_architectures", "supported_gguf_architectures", "unregister"]
