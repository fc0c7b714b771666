"""A small byte-level BPE tokenizer trained locally, deterministically, for the tiny models.

The corpus is generated from a seeded RNG: common English words, invented syllable words,
numbers, accented Latin, CJK, Hangul and emoji (multi-byte UTF-8, so a character can span
tokens, which the detokenizer must handle). Same seed and vocab size -> same tokenizer.json.
"""

from __future__ import annotations

import random

from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

BOS = "<|bos|>"
EOS = "<|eos|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (BOS, EOS, IM_START, IM_END)  # ids 0..3, in this order

# ChatML-like; no BOS inside: encode the rendered prompt with add_special_tokens=True.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_COMMON = ("the of and to in is that for it as with was on be by at this from or an are not "
           "you we they he she model token cache block prefill decode server request").split()
_SYLLABLES = ("ka lo mi ne ru ta shi ven dor el ia qu zen pa tor bel os im ar un "
              "fi go la re se").split()
_ACCENTED = ("café naïve über señor façade crème smörgåsbord Ærø déjà jalapeño "
             "Ångström fiancée São Kraków").split()
_CJK = ("你好 世界 模型 数据 东京 日本語 한국어 서울 こんにちは 漢字").split()
_EMOJI = ("🙂 🚀 🎉 🌍 👩‍💻 🐍 ❤️ ✨ 🤖 🔥").split()
_PUNCT = (".", ",", "!", "?", ":", ";", "")

# Qwen2's pre-tokenizer split (letters runs, single digits, punctuation runs, whitespace). Using
# the same pipeline as real Qwen checkpoints keeps transformers' Qwen2Tokenizer, which rebuilds
# the pipeline itself instead of reading it from tokenizer.json, in agreement with the file.
SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
               r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def _word(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.35:
        w = rng.choice(_COMMON)
    elif r < 0.75:
        w = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
    elif r < 0.83:
        w = rng.choice(_ACCENTED)
    elif r < 0.90:
        w = rng.choice(_CJK)
    elif r < 0.94:
        w = rng.choice(_EMOJI)
    else:
        w = str(rng.randint(0, 9999))
    return w.capitalize() if rng.random() < 0.1 else w


def make_corpus(seed: int, num_lines: int) -> list[str]:
    """Deterministic pseudo-text lines for tokenizer training."""
    rng = random.Random(seed)
    return [" ".join(_word(rng) for _ in range(rng.randint(4, 16))) + rng.choice(_PUNCT)
            for _ in range(num_lines)]


def train_tokenizer(vocab_size: int, seed: int) -> Tokenizer:
    """Byte-level BPE with exactly `vocab_size` tokens (specials first) and a BOS post-processor.

    Raises RuntimeError if the corpus was too small to reach vocab_size merges.
    """
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    # ~1.5 lines per vocab entry leaves enough distinct pairs to reach vocab_size merges.
    tok.train_from_iterator(make_corpus(seed, max(2000, vocab_size * 3 // 2)), trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer reached {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return tok


def tokenizer_config(max_len: int, tokenizer_class: str = "PreTrainedTokenizerFast") -> dict:
    """tokenizer_config.json contents matching `train_tokenizer`'s special tokens."""
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True}
             for i, t in enumerate(SPECIAL_TOKENS)}
    return {
        "tokenizer_class": tokenizer_class,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
