"""Llama (LlamaForCausalLM; also SmolLM2, TinyLlama): no q/k/v bias unless `attention_bias`
(which biases o_proj too), no q/k norm. The one family served from GGUF files too: llama.cpp's
`llama` architecture, whose tensor names map onto Hugging Face's here."""

from __future__ import annotations

import re
from typing import Any

from engine.models.families.base import Family, llama_layer_slots, llama_shaped_config

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def config(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    return llama_shaped_config(cfg, name, default_bias=False, qk_norm=False)


def gguf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama GGUF tensor; None for names we do not know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


FAMILY = Family("llama", ("LlamaForCausalLM",), config, llama_layer_slots,
                gguf_architecture="llama", gguf_name=gguf_name)
