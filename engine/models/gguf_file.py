"""A GGUF checkpoint: its metadata as plain values and the ModelArch it describes.

The file is memory-mapped by our GGUFReader (engine.models.gguf_reader); nothing here reads
tensor data. Only the GGUF architectures a model family names are served (engine/models/
families/: llama, for SmolLM2, TinyLlama-style and Llama-family exports): any other
`general.architecture`, a mixture of experts, partial rotary or rope scaling we do not implement
fails here with a ValueError naming what the file holds, never later inside a forward.
"""

from __future__ import annotations

import functools
import os
import struct
from typing import Any

from engine.models.arch import DEFAULT_ROPE_THETA, ModelArch, RopeConfig
from engine.models.families import gguf_family, supported_gguf_architectures
from engine.models.gguf_reader import GGUFReader

# Tensor types we dequantize (gguf.quants, checked against its quantize round trip in tests).
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


class GGUFFile:
    """Read-only view of one GGUF file. Safe to share between threads once built."""

    def __init__(self, path: str) -> None:
        if not os.path.isfile(path):
            raise ValueError(f"GGUF file {path!r} does not exist")
        self.path = path
        try:
            self.reader = GGUFReader(path)
        except (ValueError, OSError, struct.error, UnicodeDecodeError) as exc:
            raise ValueError(f"{path!r} is not a readable GGUF file: {exc}") from exc
        self.architecture = str(self.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        """Metadata value (str, int, float, bool or list of those); `default` when absent."""
        return self.reader.fields.get(key, default)

    def arch_key(self, key: str, default: Any = None) -> Any:
        """`<architecture>.<key>`, as llama.cpp spells hyper-parameters."""
        return self.get(f"{self.architecture}.{key}", default)

    @functools.cached_property
    def tensor_names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.reader.tensors)


def _positive_int(gf: GGUFFile, key: str, default: int | None = None) -> int:
    value = gf.arch_key(key, default)
    if value is None:
        raise ValueError(f"{gf.path}: GGUF metadata has no {gf.architecture}.{key}")
    return int(value)


def _rope(gf: GGUFFile) -> RopeConfig:
    theta = float(gf.arch_key("rope.freq_base", DEFAULT_ROPE_THETA))
    kind = gf.arch_key("rope.scaling.type", "none") or "none"
    if "rope_freqs.weight" in gf.tensor_names:
        raise ValueError(f"{gf.path}: rope frequency factors (rope_freqs.weight, Llama 3.1-style "
                         "rope scaling) are not supported")
    if kind == "none":
        return RopeConfig(theta=theta)
    if kind == "linear":
        return RopeConfig("linear", theta, float(gf.arch_key("rope.scaling.factor", 1.0)))
    raise ValueError(f"{gf.path}: rope scaling {kind!r} is not supported (supported: none, linear)")


def check_tensor_types(gf: GGUFFile) -> None:
    """Raise ValueError naming every tensor (and its type) we cannot dequantize."""
    bad = sorted({f"{t.name} ({t.type_name})" for t in gf.reader.tensors
                  if t.type_name not in SUPPORTED_TENSOR_TYPES})
    if bad:
        raise ValueError(f"{gf.path}: unsupported GGUF tensor type(s): {', '.join(bad[:6])}"
                         + (f" (+{len(bad) - 6} more)" if len(bad) > 6 else "")
                         + f" (supported: {', '.join(SUPPORTED_TENSOR_TYPES)})")


def gguf_arch(gf: GGUFFile) -> ModelArch:
    """The ModelArch a llama-architecture GGUF file describes (dequantized: float32 by default).

    Raises ValueError naming the architecture for anything but llama, the tensors of a type we
    cannot dequantize, and the field for missing or unsupported hyper-parameters.
    """
    family = gguf_family(gf.architecture)
    if family is None:
        raise ValueError(f"unsupported GGUF architecture {gf.architecture!r} in {gf.path} "
                         f"(supported: {', '.join(supported_gguf_architectures())})")
    if int(gf.arch_key("expert_count", 0) or 0) > 0:
        raise ValueError(f"{gf.path}: mixture-of-experts llama GGUF files are not supported")
    check_tensor_types(gf)  # here, so every process refuses the file before loading anything
    hidden = _positive_int(gf, "embedding_length")
    heads = _positive_int(gf, "attention.head_count")
    kv_heads = _positive_int(gf, "attention.head_count_kv", heads)
    head_dim = _positive_int(gf, "attention.key_length", hidden // heads)
    if _positive_int(gf, "attention.value_length", head_dim) != head_dim:
        raise ValueError(f"{gf.path}: key_length != value_length is not supported")
    rotary = _positive_int(gf, "rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ValueError(f"{gf.path}: partial rotary ({rotary} of {head_dim} dims) is not "
                         "supported")
    tokens = gf.get("tokenizer.ggml.tokens")
    vocab = gf.arch_key("vocab_size") or (len(tokens) if tokens is not None else None)
    if vocab is None:
        raise ValueError(f"{gf.path}: GGUF metadata has no vocab_size and no tokenizer tokens")
    bos = gf.get("tokenizer.ggml.bos_token_id")
    eos = gf.get("tokenizer.ggml.eos_token_id")
    return ModelArch(
        architecture=family.architectures[0],
        hidden_size=hidden,
        num_layers=_positive_int(gf, "block_count"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=int(vocab),
        max_position_embeddings=_positive_int(gf, "context_length", 2048),
        torch_dtype="float32",
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=[int(eos)] if eos is not None else [],
        tie_word_embeddings="output.weight" not in gf.tensor_names,
        intermediate_size=_positive_int(gf, "feed_forward_length"),
        rms_norm_eps=float(gf.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope=_rope(gf),
    )


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, mtime_ns: int) -> GGUFFile:
    del mtime_ns  # part of the key only: a rewritten file is read again
    return GGUFFile(path)


def open_gguf(path: str) -> GGUFFile:
    """A shared GGUFFile per path (and modification time): parsing the vocabulary takes
    seconds, and the arch, the tokenizer and the weights of one process all read the same file.
    """
    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError as exc:
        raise ValueError(f"GGUF file {path!r} does not exist") from exc
    return _open_cached(os.path.abspath(path), mtime)


def load_gguf_arch(path: str) -> ModelArch:
    return gguf_arch(open_gguf(path))
