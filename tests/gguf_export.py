"""Write a Hugging Face llama directory (the tiny test model) as a GGUF file, as llama.cpp's
converter does: llama tensor names, q/k rows permuted for its rope layout, gpt2 tokenizer
metadata, every matrix in one chosen tensor type (norms stay F32, as llama.cpp keeps them)."""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
from safetensors.numpy import load_file

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's permute: rotate-half rows -> interleaved pairs."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_name(hf: str) -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{_LAYER[rest]}"


def encode(w: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    if w.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
        return w.astype(np.float32)
    if qtype == gguf.GGMLQuantizationType.F16:
        return w.astype(np.float16)
    return gguf.quants.quantize(w.astype(np.float32), qtype)


def export_gguf(model_dir: str, path: str, qtype: str = "F32", *, architecture: str = "llama",
                tensor_hook=None) -> dict[str, np.ndarray]:  # noqa: ANN001
    """Write `path`; returns what each HF tensor should load as (the type's round trip)."""
    q = gguf.GGMLQuantizationType[qtype]
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(model_dir, "tokenizer.json")) as f:
        tok = json.load(f)
    with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
        tok_cfg = json.load(f)
    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    w = gguf.GGUFWriter(path, architecture)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    vocab = tok["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    for added in tok["added_tokens"]:
        tokens[added["id"]] = added["content"]
    special = {a["id"] for a in tok["added_tokens"] if a.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_chat_template(tok_cfg["chat_template"])
    from engine.models import Tokenizer

    w.add_add_bos_token(Tokenizer.from_dir(model_dir).encode("a")[:1] == [cfg["bos_token_id"]])
    expected = {}
    for name, t in weights.items():
        t = t.astype(np.float32)
        stored = t
        if name.endswith("q_proj.weight"):
            stored = permute(t, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            stored = permute(t, cfg["num_key_value_heads"])
        data = encode(stored, q)
        raw = None if data.dtype in (np.float32, np.float16) else q
        if tensor_hook is not None:  # (name, data, type) -> (data, type): test a bad type
            data, raw = tensor_hook(gguf_name(name), data, raw)
        w.add_tensor(gguf_name(name), data, raw_dtype=raw)
        # Blocks run along rows, so the round trip commutes with the row permutation.
        plain = encode(t, q)
        expected[name] = (plain.astype(np.float32) if plain.dtype != np.uint8
                          else gguf.quants.dequantize(plain, q)).reshape(t.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected
