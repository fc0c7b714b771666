"""Checkpoint formats: which reader a MODEL argument needs, picked here and nowhere else.

A Hugging Face directory (config.json, tokenizer.json, safetensors) or a GGUF file (after an
alias is resolved, engine/models/source.py). `load_arch`, `load_tokenizer` and `load_weights`
call that format's reader; arch.py and tokenizer.py know no format beyond their own types.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from engine.models.arch import ModelArch
from engine.models.gguf_file import load_gguf_arch, open_gguf
from engine.models.gguf_tokenizer import gguf_tokenizer
from engine.models.hf_config import load_hf_arch
from engine.models.source import is_gguf, resolve_model
from engine.models.tokenizer import Tokenizer

if TYPE_CHECKING:
    from engine.models.causal_lm import CausalLM


def load_arch(model: str) -> ModelArch:
    """The ModelArch of a model directory's config.json, or of a `.gguf` file's (or packaged
    alias's) metadata. Raises ValueError naming what cannot be served."""
    if os.path.isdir(model):
        return load_hf_arch(model)
    return load_gguf_arch(resolve_model(model))  # a .gguf file or a packaged alias


def load_tokenizer(model: str) -> Tokenizer:
    """The tokenizer of a model directory, or of a GGUF file (rebuilt from its metadata)."""
    model = resolve_model(model)
    if is_gguf(model):
        return gguf_tokenizer(open_gguf(model))
    return Tokenizer.from_dir(model)


def load_weights(model: CausalLM, path: str) -> None:
    """Fill `model` from the safetensors of a directory or the tensors of a GGUF file (a path
    resolve_model returned). The readers (torch) are imported here, not with the module: the
    API server reads archs and tokenizers through this module without loading torch."""
    if is_gguf(path):
        from engine.models.gguf_weights import load_gguf_weights

        load_gguf_weights(model, path)
    else:
        from engine.models.weights import load_hf_weights

        load_hf_weights(model, path)
