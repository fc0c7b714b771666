"""GGUF loading on the tiny model written as GGUF (tests/gguf_export.py): names, q/k
un-permutation, every supported tensor type, clear refusals, streamed loading's peak memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from gguf_export import export_gguf

from engine.models import Tokenizer, load_arch, load_model, load_tokenizer
from engine.models.gguf_file import SUPPORTED_TENSOR_TYPES
from engine.models.source import resolve_model

PROMPT = "the model token cache block prefill decode"


def _params(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def _logits(model, ids: list[int]) -> torch.Tensor:
    def attn(_layer, q, k, v):
        kk = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        vv = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), is_causal=True)
        return o.transpose(0, 1)

    with torch.inference_mode():
        ids_t = torch.tensor(ids)
        hidden = model(ids_t, torch.arange(len(ids)), attn)
        return model.compute_logits(hidden)


def test_f32_gguf_loads_exactly_the_safetensors_weights(tiny_model, tmp_path):
    path = str(tmp_path / "tiny.gguf")
    export_gguf(tiny_model, path, "F32")
    arch_hf, arch_gguf = load_arch(tiny_model), load_arch(path)
    for field in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "vocab_size", "intermediate_size", "tie_word_embeddings", "bos_token_id",
                  "eos_token_ids", "rope"):
        assert getattr(arch_gguf, field) == getattr(arch_hf, field), field
    assert arch_gguf.rms_norm_eps == pytest.approx(arch_hf.rms_norm_eps)
    ours, ref = _params(load_model(path)), _params(load_model(tiny_model))
    assert ours.keys() == ref.keys()
    for name, p in ref.items():
        assert torch.equal(ours[name], p), name  # q/k un-permuted back exactly
    ids = Tokenizer.from_dir(tiny_model).encode(PROMPT)
    assert load_tokenizer(path).encode(PROMPT) == ids
    assert load_tokenizer(path).apply_chat_template(
        [{"role": "user", "content": "hi"}]) == Tokenizer.from_dir(tiny_model).apply_chat_template(
        [{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("qtype", [t for t in SUPPORTED_TENSOR_TYPES if t != "F32"])
def test_each_supported_tensor_type_dequantizes_to_its_round_trip(tiny_model, tmp_path, qtype):
    path = str(tmp_path / f"tiny-{qtype}.gguf")
    expected = export_gguf(tiny_model, path, qtype)
    ours = load_model(path)
    q, k, v = expected["model.layers.1.self_attn.q_proj.weight"], \
        expected["model.layers.1.self_attn.k_proj.weight"], \
        expected["model.layers.1.self_attn.v_proj.weight"]
    fused = ours.layers[1].qkv_weight.numpy()
    np.testing.assert_array_equal(fused, np.concatenate([q, k, v]))
    np.testing.assert_array_equal(ours.embed_tokens.numpy(),
                                  expected["model.embed_tokens.weight"])
    np.testing.assert_array_equal(ours.lm_head.numpy(), expected["lm_head.weight"])
    # The quantized model still computes about what the float32 one does.
    ids = Tokenizer.from_dir(tiny_model).encode(PROMPT)
    low, full = _logits(ours, ids), _logits(load_model(tiny_model), ids)
    tol = {"F16": 0.01, "BF16": 0.05, "Q8_0": 0.05}.get(qtype, 0.5)
    assert (low - full).abs().max() < tol * full.abs().max()


def test_dequantized_into_the_serving_dtype(tiny_model, tmp_path):
    path = str(tmp_path / "tiny-q8.gguf")
    expected = export_gguf(tiny_model, path, "Q8_0")
    bf16 = load_model(path, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    want = torch.from_numpy(expected["model.layers.0.mlp.down_proj.weight"]).bfloat16()
    assert torch.equal(bf16.layers[0].down_weight, want)


def test_other_architecture_is_refused_naming_it(tiny_model, tmp_path):
    path = str(tmp_path / "qwen.gguf")
    export_gguf(tiny_model, path, "F32", architecture="qwen2")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'qwen2'"):
        load_arch(path)


def test_unsupported_tensor_type_is_refused_naming_tensor_and_type(tiny_model, tmp_path):
    path = str(tmp_path / "k.gguf")
    q4_k = gguf.GGMLQuantizationType.Q4_K

    def as_q4_k(name: str, data: np.ndarray, raw):  # noqa: ANN001, ANN202
        if name != "blk.2.ffn_up.weight":
            return data, raw
        block, size = gguf.GGML_QUANT_SIZES[q4_k]
        return np.zeros((data.shape[0], 256 // block * size), dtype=np.uint8), q4_k

    export_gguf(tiny_model, path, "Q8_0", tensor_hook=as_q4_k)
    for load in (load_arch, load_model):  # refused before any weight is read
        with pytest.raises(ValueError, match=r"blk\.2\.ffn_up\.weight \(Q4_K\).*supported: F32"):
            load(path)


def test_alias_and_missing_model_errors_name_the_fix(tmp_path):
    assert resolve_model("smollm2").endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    with pytest.raises(ValueError, match="alias"):
        resolve_model(str(tmp_path / "nope"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model(str(tmp_path / "weights.bin"))


_PEAK_SCRIPT = """
import json, resource, sys, torch
from engine.models import load_model
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
model = load_model(sys.argv[1], dtype=sys.argv[2])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
size = sum(p.numel() * p.element_size() for p in model.parameters())
largest = max(p.numel() for p in model.parameters()) * 4
print(json.dumps({"base_kib": base, "peak_kib": peak, "model_bytes": size,
                  "largest_fp32_bytes": largest}))
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_streamed_loading_peak_memory_is_far_below_two_models(dtype):
    """Loading SmolLM2 (Q4_1, 94 MiB file) grows the process by the model in its dtype plus
    a bounded overhead: the mapped file and about one float32 tensor (the embedding, 108 MiB)
    with its dequantization temporaries — not a second, fp32 copy of the model. Measured here:
    float32 513 MiB model, peak +684..714 MiB; bfloat16 257 MiB model, peak +428..455 MiB."""
    path = resolve_model("smollm2")
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, path, dtype], check=True,
                         capture_output=True, text=True, env={**os.environ}).stdout
    r = json.loads(out.strip().splitlines()[-1])
    grown = (r["peak_kib"] - r["base_kib"]) * 1024
    overhead = grown - r["model_bytes"]
    print(f"{dtype}: model {r['model_bytes'] / 2**20:.0f} MiB, load grew peak RSS by "
          f"{grown / 2**20:.0f} MiB (overhead {overhead / 2**20:.0f} MiB)")
    assert overhead < os.path.getsize(path) + 2 * r["largest_fp32_bytes"]
