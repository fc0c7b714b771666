"""The Hugging Face format's model description: config.json (and generation_config.json when
present) into a `ModelArch`, the family-specific fields by the family's module."""

from __future__ import annotations

import json
import os
from typing import Any

from engine.models.arch import DEFAULT_ROPE_THETA, ROPE_TYPES, ModelArch, RopeConfig
from engine.models.families import family_of, supported_architectures

_DTYPE_NAMES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16",
                "float16": "float16", "half": "float16"}


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
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rope_type!r} "
                         f"(supported: {', '.join(ROPE_TYPES)})")
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


def load_hf_arch(model_dir: str) -> ModelArch:
    """Parse `model_dir/config.json` (+ generation_config.json) into a ModelArch, the
    family's own fields by its module (engine/models/families/).

    Raises ValueError for an unsupported architecture (naming it), sliding-window attention,
    unknown rope scaling, or missing/invalid fields.
    """
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{model_dir!r} is not a model directory: no config.json")
    cfg = _read_json(path)
    archs = cfg.get("architectures") or []
    if not archs:
        raise ValueError(f"{path} lists no architectures")
    name = archs[0]
    if name not in supported_architectures():
        raise ValueError(f"unsupported architecture {name!r} in {path} "
                         f"(supported: {', '.join(supported_architectures())})")
    family_fields = family_of(name).config(cfg, name)

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
        **family_fields,
    )
