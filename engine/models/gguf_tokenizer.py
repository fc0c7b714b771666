"""The tokenizer a GGUF file describes, rebuilt with the `tokenizers` library.

Supports `tokenizer.ggml.model == "gpt2"` (byte-level BPE: vocabulary, merges, token types),
the family llama-architecture exports of SmolLM, Llama 3 and Qwen use. Built like transformers'
GGUF loader builds it, so token ids agree with it: byte-level pre-tokenizer (with the split
regex of the file's `tokenizer.ggml.pre` where that names a known one), control tokens (type 3)
added as special tokens, user-defined tokens (type 4) as plain added tokens, BOS/EOS/UNK/PAD
from their ids, BOS/EOS insertion from `add_bos_token` / `add_eos_token` (off unless the file
says so), and the chat template from `tokenizer.chat_template`.
"""

from __future__ import annotations

from functools import lru_cache

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from engine.models.gguf_file import GGUFFile
from engine.models.tokenizer import Tokenizer

CONTROL, USER_DEFINED = 3, 4
SUPPORTED_TOKENIZERS = ("gpt2",)

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> split regex; any other value keeps GPT-2's own (ByteLevel's regex).
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the byte-level alphabet)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def _byte_level_vocab(tokens: list[str]) -> dict[str, int]:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if not set(token) <= alphabet:  # stored as text, not in the byte alphabet: re-spell
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[token] = i
    return vocab


def _token_at(tokens: list[str], gf: GGUFFile, key: str) -> str | None:
    index = gf.get(f"tokenizer.ggml.{key}")
    return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None


def gguf_tokenizer(gf: GGUFFile) -> Tokenizer:
    """Tokenizer for the GGUF file; raises ValueError naming an unsupported tokenizer model."""
    kind = gf.get("tokenizer.ggml.model")
    if kind not in SUPPORTED_TOKENIZERS:
        raise ValueError(f"{gf.path}: unsupported GGUF tokenizer {kind!r} "
                         f"(supported: {', '.join(SUPPORTED_TOKENIZERS)} byte-level BPE)")
    tokens = [str(t) for t in gf.get("tokenizer.ggml.tokens", [])]
    merges = gf.get("tokenizer.ggml.merges") or []
    types = list(gf.get("tokenizer.ggml.token_type") or [])
    types += [0] * (len(tokens) - len(types))  # a file without types: all plain tokens
    if not tokens or not merges:
        raise ValueError(f"{gf.path}: GGUF tokenizer has no tokens or no merges")
    bpe = models.BPE(vocab=_byte_level_vocab(tokens),
                     merges=[tuple(m.split(" ", 1)) for m in merges],
                     continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                     byte_fallback=False)
    backend = _HFTokenizer(bpe)
    split = PRE_TOKENIZER_SPLITS.get(gf.get("tokenizer.ggml.pre", ""))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    alphabet = set(bytes_to_unicode().values())
    backend.add_special_tokens([
        AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types, strict=False)
        if ty == CONTROL and set(t) <= alphabet])  # other "control" spellings: mislabels
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, ty in zip(tokens, types, strict=False) if ty == USER_DEFINED])
    config = {
        "bos_token": _token_at(tokens, gf, "bos_token_id"),
        "eos_token": _token_at(tokens, gf, "eos_token_id"),
        "unk_token": _token_at(tokens, gf, "unknown_token_id"),
        "pad_token": _token_at(tokens, gf, "padding_token_id"),
        "add_bos_token": bool(gf.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(gf.get("tokenizer.ggml.add_eos_token", False)),
    }
    template = gf.get("tokenizer.chat_template")
    return Tokenizer(backend, config, template if isinstance(template, str) else None)
