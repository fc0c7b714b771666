"""Entry point of the model layer: read a local Hugging Face directory or GGUF file into the
module its model family builds (engine/models/families/), through the format's readers
(engine/models/formats.py)."""

from __future__ import annotations

import torch

from engine.kernels.linear import set_gemm_shapes
from engine.models.arch import ModelArch
from engine.models.causal_lm import CausalLM
from engine.models.families import family_of
from engine.models.formats import load_arch, load_weights
from engine.models.parallel import Collectives
from engine.models.source import resolve_model

__all__ = ["CausalLM", "ModelArch", "load_model", "resolve_dtype"]

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, arch: ModelArch) -> torch.dtype:
    """"auto" -> the checkpoint's torch_dtype (float32 when it names none we support)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}")
        return dtype
    name = arch.torch_dtype if dtype == "auto" else dtype
    if name not in _TORCH_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r} (use auto, float32, bfloat16 or float16)")
    return _TORCH_DTYPES[name]


def load_model(model_dir: str, dtype: str = "auto", device: str = "cpu", *,
               tp_rank: int = 0, tp_size: int = 1,
               comm: Collectives | None = None) -> CausalLM:
    """Build the model described by `model_dir/config.json` and load its safetensors weights,
    or build it from a `.gguf` file's metadata and dequantize its tensors into `dtype`.

    Raises ValueError for an unsupported architecture or dtype, or a checkpoint that does not
    match the config. The returned module is in eval mode with requires_grad off everywhere.
    With tp_size > 1, loads only rank tp_rank's shard and uses `comm` across ranks.
    """
    model_dir = resolve_model(model_dir)
    arch = load_arch(model_dir)
    torch_dtype = resolve_dtype(dtype, arch)
    model = family_of(arch.architecture).build(arch, torch_dtype, torch.device(device),
                                               tp_rank=tp_rank, tp_size=tp_size, comm=comm)
    load_weights(model, model_dir)
    # the skinny threshold and the float32 gemm's choice are measured on them
    set_gemm_shapes(model.layer_gemm_shapes(), len(model.layers))
    return model.eval()
