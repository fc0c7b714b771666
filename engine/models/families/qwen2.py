"""Qwen2 (Qwen2ForCausalLM): q/k/v always biased, o_proj never; no q/k norm."""

from __future__ import annotations

from typing import Any

from engine.models.families.base import Family, llama_layer_slots, llama_shaped_config


def config(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    return llama_shaped_config(cfg, name, default_bias=True, qk_norm=False)


FAMILY = Family("qwen2", ("Qwen2ForCausalLM",), config, llama_layer_slots)
