"""What a model family is: the hooks one family module supplies to the registry
(engine/models/families/__init__.py), and the Llama-shaped defaults most families share.

A family maps a Hugging Face config.json onto the family's ModelArch fields (`config`), names
its checkpoint tensors and says which part of each one tensor-parallel rank r holds
(`layer_slots`, over the rank's `TPLayout`), builds its module (`build`), and may name its GGUF
architecture and tensor names (`gguf_architecture`, `gguf_name`). A new family is one new
module beside llama.py / qwen2.py / qwen3.py, listed in the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.models.arch import ModelArch

if TYPE_CHECKING:  # the module and its tensors are loaded only where a model is built
    import torch

    from engine.models.causal_lm import CausalLM
    from engine.models.parallel import Collectives
    from engine.models.slots import Slot

# config.json -> the family's own ModelArch fields (qkv_bias, o_bias, qk_norm, ...);
# (cfg, architecture name) -> fields; raises ValueError naming what the family cannot run.
ConfigFn = Callable[[dict[str, Any], str], dict[str, Any]]
LayerSlotsFn = Callable[["CausalLM", int], "dict[str, Slot]"]
BuildFn = Callable[..., "CausalLM"]


def build_causal_lm(arch: ModelArch, dtype: torch.dtype, device: torch.device | str = "cpu",
                    tp_rank: int = 0, tp_size: int = 1,
                    comm: Collectives | None = None) -> CausalLM:
    """The Llama-shaped decoder (engine/models/causal_lm.py) most families run on."""
    from engine.models.causal_lm import CausalLM

    return CausalLM(arch, dtype, device, tp_rank=tp_rank, tp_size=tp_size, comm=comm)


def check_tp(arch: ModelArch, tp_size: int) -> None:
    """The tensor-parallel checks of the Llama-shaped decoder (engine/models/parallel.py)."""
    from engine.models.parallel import check_tp as check

    check(arch, tp_size)


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]  # config.json `architectures[0]` values it serves
    config: ConfigFn
    layer_slots: LayerSlotsFn  # HF tensor name -> Slot of layer i (this rank's shard)
    build: BuildFn = build_causal_lm  # (arch, dtype, device, tp_rank, tp_size, comm) -> module
    check_tp: Callable[[ModelArch, int], None] = check_tp
    gguf_architecture: str | None = None  # GGUF `general.architecture` it serves
    gguf_name: Callable[[str], str | None] | None = None  # GGUF tensor name -> HF name

def llama_shaped_config(cfg: dict[str, Any], name: str, *, default_bias: bool,
                        qk_norm: bool) -> dict[str, Any]:
    """The checks every family on CausalLM makes, and its attention flags: q/k/v biased by
    default (`default_bias`, Qwen2) or by `attention_bias`, which also biases o_proj where the
    family does not bias q/k/v by default; per-head q/k RMSNorm (`qk_norm`, Qwen3)."""
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{name}: sliding-window attention is not supported")
    if cfg.get("mlp_bias"):
        raise ValueError(f"{name}: mlp_bias is not supported")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{name}: hidden_act {act!r} is not supported (only silu)")
    attention_bias = bool(cfg.get("attention_bias", False))
    return {"qkv_bias": default_bias or attention_bias,
            "o_bias": not default_bias and attention_bias,
            "qk_norm": qk_norm}


def llama_layer_slots(model: CausalLM, i: int) -> dict[str, Slot]:
    """Layer i's Hugging Face tensors in a Llama-shaped model, and this rank's share of each:
    q/k/v, gate/up by rows (KV heads from the layout's first KV head), o_proj and down_proj by
    columns; biases and q/k norms where the layer has them."""
    from engine.models.slots import Slot

    layer = model.layers[i]
    a, lay = model.arch, model.layout
    qs, kvs, inter = layer.q_size, layer.kv_size, layer.inter_size
    q0, kv0, i0 = lay.rank * qs, lay.kv_head_start * a.head_dim, lay.rank * inter
    fq, fkv, fi = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.intermediate_size
    p = "self_attn."
    slots = {
        "input_layernorm.weight": Slot(layer.input_norm),
        "post_attention_layernorm.weight": Slot(layer.post_attn_norm),
        p + "q_proj.weight": Slot(layer.qkv_weight, 0, 0, qs, 0, q0, fq),
        p + "k_proj.weight": Slot(layer.qkv_weight, 0, qs, kvs, 0, kv0, fkv),
        p + "v_proj.weight": Slot(layer.qkv_weight, 0, qs + kvs, kvs, 0, kv0, fkv),
        p + "o_proj.weight": Slot(layer.o_weight, 1, 0, qs, 1, q0, fq),
        "mlp.gate_proj.weight": Slot(layer.gate_up_weight, 0, 0, inter, 0, i0, fi),
        "mlp.up_proj.weight": Slot(layer.gate_up_weight, 0, inter, inter, 0, i0, fi),
        "mlp.down_proj.weight": Slot(layer.down_weight, 1, 0, inter, 1, i0, fi),
    }
    if layer.qkv_bias is not None:
        slots[p + "q_proj.bias"] = Slot(layer.qkv_bias, 0, 0, qs, 0, q0, fq)
        slots[p + "k_proj.bias"] = Slot(layer.qkv_bias, 0, qs, kvs, 0, kv0, fkv)
        slots[p + "v_proj.bias"] = Slot(layer.qkv_bias, 0, qs + kvs, kvs, 0, kv0, fkv)
    if layer.o_bias is not None:
        slots[p + "o_proj.bias"] = Slot(layer.o_bias)
    if layer.q_norm is not None:
        slots[p + "q_norm.weight"] = Slot(layer.q_norm)
        slots[p + "k_norm.weight"] = Slot(layer.k_norm)
    return {f"model.layers.{i}.{name}": slot for name, slot in slots.items()}

