"""Safetensors checkpoint -> CausalLM parameters (fusing q/k/v and gate/up, sharding for TP;
the layers' tensor names and shards are the model family's, engine/models/families/).

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

from safetensors import safe_open

from engine.models.causal_lm import CausalLM
from engine.models.families import family_of
from engine.models.slots import Slot

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


def parameter_slots(model: CausalLM) -> dict[str, Slot]:
    """Hugging Face tensor name -> where it lands in `model` (shared with the GGUF loader)."""
    lay = model.layout
    vocab = (0, lay.vocab_start, lay.vocab_size)  # shard_dim, shard_start, full_len
    slots = {"model.embed_tokens.weight": Slot(model.embed_tokens, 0, 0, None, *vocab),
             "model.norm.weight": Slot(model.norm)}
    if not model.arch.tie_word_embeddings:
        slots["lm_head.weight"] = Slot(model.lm_head, 0, 0, None, *vocab)
    layer_slots = family_of(model.arch.architecture).layer_slots
    for i in range(model.arch.num_layers):
        slots.update(layer_slots(model, i))
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


def load_hf_weights(model: CausalLM, model_dir: str) -> None:
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
