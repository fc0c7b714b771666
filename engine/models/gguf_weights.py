"""GGUF tensors -> CausalLM parameters, one tensor at a time, dequantized to the model dtype.

Streaming: each tensor is read from the memory-mapped file, dequantized to a float32 array
(only that tensor's), un-permuted if it is a q/k projection, sharded, and copied (cast) into its
place in the model; then dropped. Peak memory is the model in its serving dtype plus about one
float32 tensor (the embedding is the largest) and the file's pages (file-backed, shared with
every process mapping it), never a second copy of the model.

llama.cpp's converter permutes the rows of q_proj and k_proj per head from Hugging Face's
rotate-half layout (first half / second half of a head) into interleaved pairs (its rope
kernel's layout); `unpermute_qk` undoes it so our rotate-half rope sees HF's weights.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.models.causal_lm import CausalLM
from engine.models.families import family_of
from engine.models.gguf_file import GGUFFile, check_tensor_types, open_gguf
from engine.models.gguf_reader import TensorInfo
from engine.models.slots import Slot
from engine.models.weights import parameter_slots


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute(w, n_head)`: interleaved rope pairs -> rotate-half rows."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (weight.reshape(num_heads, half, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def dequantize(gf: GGUFFile, tensor: TensorInfo) -> np.ndarray:
    """float32 array in Hugging Face orientation ([out, in] for matrices) of one GGUF tensor."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as _dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists ne0 (columns) first
    data = gf.reader.data(tensor)
    return np.asarray(_dequantize(data, GGMLQuantizationType(tensor.type_id)),
                      dtype=np.float32).reshape(shape)


def load_gguf_weights(model: CausalLM, path: str) -> None:
    """Fill every parameter of `model` from the GGUF file at `path`.

    Raises ValueError naming the tensor when one is missing, unknown, of an unsupported type
    or of the wrong shape; type checks run before any data is read.
    """
    gf = open_gguf(path)
    check_tensor_types(gf)
    hf_name = family_of(model.arch.architecture).gguf_name  # GGUF name -> HF name
    slots = parameter_slots(model)
    tied = model.arch.tie_word_embeddings
    unknown = [t.name for t in gf.reader.tensors if hf_name(t.name) is None]
    if unknown:
        raise ValueError(f"{path}: unexpected tensors for llama: {', '.join(unknown[:8])}")
    loaded: set[str] = set()
    for tensor in gf.reader.tensors:
        name = hf_name(tensor.name)
        if name == "lm_head.weight" and tied:
            continue
        if name not in slots:
            raise ValueError(f"{path}: unexpected tensor {tensor.name} ({name})")
        weight = dequantize(gf, tensor)
        if name.endswith("q_proj.weight"):
            weight = unpermute_qk(weight, model.arch.num_heads)
        elif name.endswith("k_proj.weight"):
            weight = unpermute_qk(weight, model.arch.num_kv_heads)
        _copy(weight, tensor.name, slots[name])
        loaded.add(name)
        del weight
    missing = sorted(set(slots) - loaded)
    if missing:
        raise ValueError(f"{path}: missing tensors: {', '.join(missing[:8])}"
                         + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""))


def _copy(weight: np.ndarray, name: str, slot: Slot) -> None:
    full = slot.full_shape()
    if list(weight.shape) != full:
        raise ValueError(f"tensor {name} has shape {list(weight.shape)}, expected {full}")
    if not weight.flags.writeable:  # a float32 tensor is a view of the read-only mapping
        weight = weight.copy()
    src = torch.from_numpy(weight)
    bounds = slot.shard_bounds()
    if bounds is not None:
        src = src.narrow(slot.shard_dim, bounds[0], bounds[1] - bounds[0])
    slot.write(src)
