"""`pdserve make-tiny-model`: a seeded random Hugging Face model directory for tests and demos.

The directory loads with transformers' AutoModelForCausalLM / AutoTokenizer and with our
loader. Same (arch, size, seed) -> byte-identical files.

Weights are random but not "std 0.02 everywhere": that init gives near-uniform logits whose
argmax flips on float rounding, which would make exact greedy comparisons flaky. Here the
token embedding dominates the residual stream, layers add a context-dependent perturbation of
a fraction of its size, and lm_head is scaled so logits spread over several units; the top-1
margin is then typically O(1) while the output still depends on the whole context.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

import torch
from safetensors.torch import save_file

from engine.models.tiny_tokenizer import (
    EOS,
    SPECIAL_TOKENS,
    tokenizer_config,
    train_tokenizer,
)


@dataclass(frozen=True)
class _Size:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    intermediate: int
    qwen3_head_dim: int  # deliberately != hidden // heads, as in real Qwen3


SIZES = {
    "tiny": _Size(256, 4, 4, 2, 2048, 640, 96),
    "bench": _Size(512, 8, 8, 4, 8192, 1408, 128),
}
ARCHS = {
    "llama": ("LlamaForCausalLM", "llama", 10_000.0),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", 1_000_000.0),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", 1_000_000.0),
}
MAX_POSITIONS = 4096

# Init scales (see module docstring).
EMBED_STD = 1.0
PROJ_STD = 0.06
BIAS_STD = 0.1
NORM_JITTER = 0.1
LOGIT_STD = 4.0  # target std of one logit; lm_head std = LOGIT_STD / sqrt(hidden)
SPECIAL_LOGIT_DAMP = 0.2  # bos / chat markers are rarely predicted (eos stays a normal token)


def _config(arch: str, s: _Size, tie: bool) -> dict:
    name, model_type, theta = ARCHS[arch]
    head_dim = s.qwen3_head_dim if arch == "qwen3" else s.hidden // s.heads
    cfg = {
        "architectures": [name],
        "model_type": model_type,
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "rope_theta": theta,
        "rope_scaling": None,
        "tie_word_embeddings": tie,
        "torch_dtype": "float32",
        "vocab_size": s.vocab,
        "bos_token_id": SPECIAL_TOKENS.index("<|bos|>"),
        "eos_token_id": SPECIAL_TOKENS.index(EOS),
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if arch in ("llama", "qwen3"):
        cfg["attention_bias"] = False
    if arch == "llama":
        cfg["mlp_bias"] = False
    if arch in ("qwen2", "qwen3"):
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=s.layers)
    return cfg


def _weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden, head_dim = cfg["hidden_size"], cfg["head_dim"]
    q_size = cfg["num_attention_heads"] * head_dim
    kv_size = cfg["num_key_value_heads"] * head_dim
    inter, vocab = cfg["intermediate_size"], cfg["vocab_size"]

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm(n: int) -> torch.Tensor:
        return 1.0 + randn(n, std=NORM_JITTER)

    w = {"model.embed_tokens.weight": randn(vocab, hidden, std=EMBED_STD)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(hidden)
        w[p + "post_attention_layernorm.weight"] = norm(hidden)
        for proj, rows in (("q", q_size), ("k", kv_size), ("v", kv_size)):
            w[p + f"self_attn.{proj}_proj.weight"] = randn(rows, hidden, std=PROJ_STD)
            if cfg["model_type"] == "qwen2":
                w[p + f"self_attn.{proj}_proj.bias"] = randn(rows, std=BIAS_STD)
        w[p + "self_attn.o_proj.weight"] = randn(hidden, q_size, std=PROJ_STD)
        if cfg["model_type"] == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm(head_dim)
            w[p + "self_attn.k_norm.weight"] = norm(head_dim)
        w[p + "mlp.gate_proj.weight"] = randn(inter, hidden, std=PROJ_STD)
        w[p + "mlp.up_proj.weight"] = randn(inter, hidden, std=PROJ_STD)
        w[p + "mlp.down_proj.weight"] = randn(hidden, inter, std=PROJ_STD)
    w["model.norm.weight"] = norm(hidden)
    if not cfg["tie_word_embeddings"]:
        lm_head = randn(vocab, hidden, std=LOGIT_STD / hidden ** 0.5)
        for tid, tok in enumerate(SPECIAL_TOKENS):
            if tok != EOS:
                lm_head[tid] *= SPECIAL_LOGIT_DAMP
        w["lm_head.weight"] = lm_head
    return {k: v.contiguous() for k, v in w.items()}


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


def make_tiny_model(out_dir: str, arch: str = "llama", size: str = "tiny", seed: int = 0, *,
                    tie_word_embeddings: bool = False) -> None:
    """Write a complete HF-format model directory (config, weights, tokenizer) to `out_dir`."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r} (choose from {', '.join(ARCHS)})")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r} (choose from {', '.join(SIZES)})")
    s = SIZES[size]
    cfg = _config(arch, s, tie_word_embeddings)
    os.makedirs(out_dir, exist_ok=True)
    _write_json(os.path.join(out_dir, "config.json"), cfg)
    _write_json(os.path.join(out_dir, "generation_config.json"),
                {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]})
    save_file(_weights(cfg, seed), os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    tok = train_tokenizer(s.vocab, seed)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    tok_class = "Qwen2Tokenizer" if arch in ("qwen2", "qwen3") else "PreTrainedTokenizerFast"
    _write_json(os.path.join(out_dir, "tokenizer_config.json"),
                tokenizer_config(MAX_POSITIONS, tok_class))


def add_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of `pdserve make-tiny-model`."""
    parser.add_argument("dir", help="output directory (created if missing)")
    parser.add_argument("--arch", choices=sorted(ARCHS), default="llama")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)


def add_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `make-tiny-model` on an argparse subparsers object; runs `main` via `func`."""
    parser = subparsers.add_parser("make-tiny-model", help="write a random tiny model")
    add_args(parser)
    parser.set_defaults(func=main)
    return parser


def main(args: argparse.Namespace) -> int:
    make_tiny_model(args.dir, arch=args.arch, size=args.size, seed=args.seed)
    print(f"wrote {args.arch}/{args.size} model (seed {args.seed}) to {args.dir}")
    return 0
