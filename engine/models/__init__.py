"""Model layer: one module per family (families/: Llama, Qwen2, Qwen3) over flattened tokens,
the formats' readers (HF safetensors, GGUF) picked in formats.py, tokenizer."""

from engine.models.arch import ModelArch, RopeConfig
from engine.models.causal_lm import CausalLM
from engine.models.formats import load_arch, load_tokenizer
from engine.models.loader import load_model, resolve_dtype
from engine.models.tokenizer import Tokenizer

__all__ = ["CausalLM", "ModelArch", "RopeConfig", "Tokenizer", "load_arch", "load_model",
           "load_tokenizer", "resolve_dtype"]
