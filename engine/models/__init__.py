"""Model layer: Llama / Qwen2 / Qwen3 over flattened tokens, safetensors loader, tokenizer."""

from engine.models.arch import ModelArch, RopeConfig
from engine.models.causal_lm import CausalLM
from engine.models.loader import load_arch, load_model, resolve_dtype
from engine.models.tokenizer import Tokenizer

__all__ = ["CausalLM", "ModelArch", "RopeConfig", "Tokenizer", "load_arch", "load_model",
           "resolve_dtype"]
