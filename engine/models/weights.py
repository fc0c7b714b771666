"""Safetensors checkpoint -> CausalLM parameters (fusing q/k/v and gate/up, sharding for TP).

Each checkpoint tensor is read lazily (only this rank's slice), cast to the model dtype and
copied into its place in a fused parameter. Loading fails with a ValueError naming the tensor
when one is missing, unexpected, or of the wrong shape, so a checkpoint never half-loads.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Iterator

import torch
from safetensors import safe_open

from engine.models.causal_lm import CausalLM

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(model_dir: str) -> list[str]:
    """The safetensors files of a model dir: from the shard index if present, else all files."""
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        return [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
    single = os.path.join(model_dir, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"no safetensors weights in {model_dir!r}")
    return files


class Slot:
    """Where one checkpoint tensor lands: dest[rows] (or dest[:, cols]) <- src[shard].

    With `shard_dim` set, the checkpoint tensor is `full_len` long along it and this rank
    takes [shard_start, shard_start + target length), cut short at full_len (the last
    vocabulary shard; its padding rows are zeroed).
    """

    __slots__ = ("dest", "dim", "start", "length", "shard_dim", "shard_start", "full_len")

    def __init__(self, dest: torch.Tensor, dim: int = 0, start: int = 0, length: int | None = None,
                 shard_dim: int | None = None, shard_start: int = 0,
                 full_len: int = 0) -> None:
        self.dest = dest
        self.dim = dim
        self.start = start
        self.length = dest.shape[dim] if length is None else length
        self.shard_dim = shard_dim
        self.shard_start = shard_start
        self.full_len = full_len

    def target(self) -> torch.Tensor:
        return self.dest.narrow(self.dim, self.start, self.length)

    def full_shape(self) -> list[int]:
        """The checkpoint tensor's expected shape."""
        shape = list(self.target().shape)
        if self.shard_dim is not None:
            shape[self.shard_dim] = self.full_len
        return shape

    def shard_bounds(self) -> tuple[int, int] | None:
        """[start, end) of this rank's part along shard_dim; None: take it whole."""
        if self.shard_dim is None:
            return None
        n = min(self.target().shape[self.shard_dim], self.full_len - self.shard_start)
        return self.shard_start, self.shard_start + n

    def write(self, src: torch.Tensor) -> None:
        """src: the checkpoint tensor already cut to shard_bounds()."""
        target = self.target()
        d = self.shard_dim
        with torch.no_grad():
            if d is not None and src.shape[d] < target.shape[d]:
                target.zero_()
                target = target.narrow(d, 0, src.shape[d])
            target.copy_(src)


def _layer_slots(model: CausalLM, i: int) -> dict[str, Slot]:
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


def parameter_slots(model: CausalLM) -> dict[str, Slot]:
    """Hugging Face tensor name -> where it lands in `model` (shared with the GGUF loader)."""
    lay = model.layout
    vocab = (0, lay.vocab_start, lay.vocab_size)  # shard_dim, shard_start, full_len
    slots = {"model.embed_tokens.weight": Slot(model.embed_tokens, 0, 0, None, *vocab),
             "model.norm.weight": Slot(model.norm)}
    if not model.arch.tie_word_embeddings:
        slots["lm_head.weight"] = Slot(model.lm_head, 0, 0, None, *vocab)
    for i in range(model.arch.num_layers):
        slots.update(_layer_slots(model, i))
    return slots


def _iter_names(files: list[str]) -> Iterator[tuple[str, str]]:
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield path, name


def _is_ignored(name: str, model: CausalLM) -> bool:
    if name.endswith(_IGNORED_SUFFIXES):
        return True
    # Tied checkpoints sometimes still carry a copy of lm_head; the embedding wins.
    return name == "lm_head.weight" and model.arch.tie_word_embeddings


def load_weights(model: CausalLM, model_dir: str) -> None:
    """Fill every parameter of `model` from the checkpoint in `model_dir`."""
    slots = parameter_slots(model)
    files = checkpoint_files(model_dir)
    by_file: dict[str, list[str]] = {}
    unexpected = []
    for path, name in _iter_names(files):
        if name in slots:
            by_file.setdefault(path, []).append(name)
        elif not _is_ignored(name, model):
            unexpected.append(name)
    if unexpected:
        raise ValueError(f"{model_dir}: unexpected tensors for {model.arch.architecture}: "
                         f"{', '.join(sorted(unexpected)[:8])}")
    loaded: set[str] = set()
    for path, names in by_file.items():
        with safe_open(path, framework="pt") as f:
            for name in names:
                _copy(f, name, slots[name])
                loaded.add(name)
    missing = sorted(set(slots) - loaded)
    if missing:
        raise ValueError(f"{model_dir}: missing tensors: {', '.join(missing[:8])}"
                         + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""))


def _copy(f, name: str, slot: Slot) -> None:
    sl = f.get_slice(name)
    shape, full = list(sl.get_shape()), slot.full_shape()
    if shape != full:
        raise ValueError(f"tensor {name} has shape {shape}, expected {full}")
    bounds = slot.shard_bounds()
    if bounds is None:
        src = sl[:]
    else:
        src = sl[bounds[0]:bounds[1]] if slot.shard_dim == 0 else sl[:, bounds[0]:bounds[1]]
    slot.write(src)
