"""Qwen3 (Qwen3ForCausalLM): per-head RMSNorm on q and k before the rotary embedding; biases
as Llama's (`attention_bias`)."""

from __future__ import annotations

from typing import Any

from engine.models.families.base import Family, llama_layer_slots, llama_shaped_config


def config(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    return llama_shaped_config(cfg, name, default_bias=False, qk_norm=True)


FAMILY = Family("qwen3", ("Qwen3ForCausalLM",), config, llama_layer_slots)
