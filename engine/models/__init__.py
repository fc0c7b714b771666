"""Model layer: one module per family (families/: Llama, Qwen2, Qwen3) over flattened tokens,
the formats' readers (HF safetensors, GGUF) picked in formats.py, tokenizer.

The names below are loaded on first use (PEP 562), so importing a light module of this
package (source, formats, arch) does not import torch: the API server reads a model's
architecture and tokenizer without it."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ModelArch": "engine.models.arch", "RopeConfig": "engine.models.arch",
    "CausalLM": "engine.models.causal_lm",
    "load_arch": "engine.models.formats", "load_tokenizer": "engine.models.formats",
    "load_model": "engine.models.loader", "resolve_dtype": "engine.models.loader",
    "Tokenizer": "engine.models.tokenizer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine.models' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
