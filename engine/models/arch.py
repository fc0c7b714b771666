"""Model architecture description read from a Hugging Face model directory.

`load_arch(model_dir)` parses config.json (and generation_config.json when present) into a
frozen `ModelArch`. It validates everything the model code relies on, so a checkpoint we cannot
run fails here with a ValueError that names the offending field, never later inside a forward.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

# architecture name -> (qkv bias by default, per-head q/k RMSNorm)
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}

_ROPE_TYPES = ("default", "linear", "llama3")
_DTYPE_NAMES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16",
                "float16": "float16", "half": "float16"}
DEFAULT_ROPE_THETA = 10_000.0


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters. `rope_type` is one of default / linear / llama3.

    `factor` is used by linear and llama3; the three llama3 fields only by llama3.
    """

    rope_type: str = "default"
    theta: float = DEFAULT_ROPE_THETA
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in _ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {self.rope_type!r} (supported: {_ROPE_TYPES})")
        if self.theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.theta}")
        if self.rope_type != "default" and self.factor <= 0:
            raise ValueError(f"rope factor must be positive, got {self.factor}")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("llama3 rope needs high_freq_factor > low_freq_factor")


@dataclass(frozen=True)
class ModelArch:
    """Shape and hyper-parameters of one decoder-only model; immutable once loaded."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    torch_dtype: str
    bos_token_id: int | None
    eos_token_ids: list[int]
    tie_word_embeddings: bool
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "vocab_size", "max_position_embeddings", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embedding, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_scale(self) -> float:
        """Softmax scale the attention callback must use: 1 / sqrt(head_dim)."""
        return self.head_dim ** -0.5


def _read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return list(value)
    raise ValueError(f"eos_token_id must be an int or a list of ints, got {value!r}")


def _parse_rope(cfg: dict[str, Any]) -> RopeConfig:
    # transformers <5 writes rope_theta + rope_scaling; >=5 rope_parameters with theta inside.
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_scaling / rope_parameters must be an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    theta = params.get("rope_theta", cfg.get("rope_theta", DEFAULT_ROPE_THETA))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rope_type!r} "
                         f"(supported: {', '.join(_ROPE_TYPES)})")
    if params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1.0 is not supported")
    if rope_type == "default":
        return RopeConfig(theta=float(theta))

    def need(key: str) -> float:
        if params.get(key) is None:
            raise ValueError(f"{rope_type} rope scaling needs {key!r}")
        return float(params[key])

    if rope_type == "linear":
        return RopeConfig("linear", float(theta), need("factor"))
    orig = params.get("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    return RopeConfig("llama3", float(theta), need("factor"), need("low_freq_factor"),
                      need("high_freq_factor"), int(orig))


def _require(cfg: dict[str, Any], key: str, path: str) -> Any:
    if key not in cfg:
        raise ValueError(f"{path} has no {key!r}")
    return cfg[key]


def load_arch(model_dir: str) -> ModelArch:
    """Parse `model_dir/config.json` (+ generation_config.json) into a ModelArch; for a
    `.gguf` file, its metadata (engine.models.gguf_file).

    Raises ValueError for an unsupported architecture (naming it), sliding-window attention,
    unknown rope scaling, or missing/invalid fields.
    """
    if not os.path.isdir(model_dir):  # a .gguf file or a packaged alias
        from engine.models.gguf_file import load_gguf_arch
        from engine.models.source import resolve_model

        return load_gguf_arch(resolve_model(model_dir))
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{model_dir!r} is not a model directory: no config.json")
    cfg = _read_json(path)
    archs = cfg.get("architectures") or []
    if not archs:
        raise ValueError(f"{path} lists no architectures")
    name = archs[0]
    if name not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {name!r} in {path} "
                         f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    default_bias, qk_norm = SUPPORTED_ARCHITECTURES[name]
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{name}: sliding-window attention is not supported")
    if cfg.get("mlp_bias"):
        raise ValueError(f"{name}: mlp_bias is not supported")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{name}: hidden_act {act!r} is not supported (only silu)")

    hidden = int(_require(cfg, "hidden_size", path))
    heads = int(_require(cfg, "num_attention_heads", path))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = cfg.get("head_dim") or hidden // heads

    gen_path = os.path.join(model_dir, "generation_config.json")
    gen = _read_json(gen_path) if os.path.isfile(gen_path) else {}
    eos = _token_ids(gen["eos_token_id"]) if gen.get("eos_token_id") is not None else \
        _token_ids(cfg.get("eos_token_id"))
    bos = gen.get("bos_token_id", cfg.get("bos_token_id"))

    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    return ModelArch(
        architecture=name,
        hidden_size=hidden,
        num_layers=int(_require(cfg, "num_hidden_layers", path)),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(head_dim),
        vocab_size=int(_require(cfg, "vocab_size", path)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        torch_dtype=_DTYPE_NAMES.get(str(dtype), "float32"),
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        intermediate_size=int(_require(cfg, "intermediate_size", path)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=_parse_rope(cfg),
        qkv_bias=default_bias or bool(cfg.get("attention_bias", False)),
        # Llama/Qwen3 put attention_bias on o_proj too; Qwen2 never biases o_proj.
        o_bias=not default_bias and bool(cfg.get("attention_bias", False)),
        qk_norm=qk_norm,
    )
