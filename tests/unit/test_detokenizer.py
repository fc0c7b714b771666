"""Incremental detokenization: multi-byte characters, special tokens, stop strings."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from engine.frontend.detokenizer import IncrementalDetokenizer
from engine.protocol import SamplingParams

CORPUS = [
    "Hello world, this is a tiny corpus for a byte-level BPE tokenizer.",
    "数据并行和张量并行是两种不同的并行方式。预填充与解码分离。",
    "日本語のテキストも少し入れておきます。東京タワー",
    "Emoji time: 🚀🔥🎉 👩‍💻 and ünïcödé àccents — naïve café.",
    "한국어 문장도 있습니다. 안녕하세요!",
    "The quick brown fox jumps over the lazy dog 0123456789.",
]


class _WrappedTokenizer:
    """The project's Tokenizer interface over a raw `tokenizers.Tokenizer` (set `_tok`)."""

    _tok: Any

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id] + ids if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def tok(tiny_model):
    """The tiny model's byte-level BPE (multi-byte characters span several tokens)."""
    from engine.models.tokenizer import Tokenizer

    return Tokenizer.from_dir(tiny_model)


def _run(tok, prompt_ids, out_ids, chunk=1, **params):
    det = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(**params))
    stop = None
    streamed = ""
    for i in range(0, len(out_ids), chunk):
        stop = det.update(out_ids[i:i + chunk], stop_terminated=False)
        if stop is not None:
            streamed += det.get_next_output_text(finished=True, delta=True)
            return det, stop, streamed
        streamed += det.get_next_output_text(finished=False, delta=True)
        assert "\ufffd" not in streamed
    det.finish()
    streamed += det.get_next_output_text(finished=True, delta=True)
    return det, stop, streamed


MIXED = "Hi 数据并行 🚀🔥 café 東京 안녕 👩‍💻!"


def test_multibyte_characters_split_across_tokens_are_never_halved(tok):
    ids = tok.encode(MIXED, add_special_tokens=False)
    # Make sure the test really exercises characters spanning several tokens.
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces), "tokenizer does not split any character"
    prompt = tok.encode("Prompt:")
    det, stop, streamed = _run(tok, prompt, ids)
    assert stop is None
    assert det.output_text == MIXED == streamed
    assert det.output_token_ids == ids


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_incremental_text_equals_full_decode_for_random_sequences(tok, chunk):
    rng = random.Random(chunk)
    alphabet = list(set("".join(CORPUS)))
    checked = 0
    for _ in range(60):
        # Random text -> ids, and random id sequences that decode without replacement chars.
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        candidates = [tok.encode(text, add_special_tokens=False)]
        rand_ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 20))]
        if "\ufffd" not in tok.decode(rand_ids):
            candidates.append(rand_ids)
        for ids in candidates:
            prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 8))]
            det, _, streamed = _run(tok, prompt, ids, chunk=chunk)
            assert det.output_text == tok.decode(ids) == streamed
            checked += 1
    assert checked >= 60


def test_final_text_flushes_incomplete_character_like_full_decode(tok):
    split = [c for c in "🚀🔥🎉👩東京탑ü数" if len(tok.encode(c, add_special_tokens=False)) >= 2]
    assert split, "tokenizer encodes every test character as one token"
    ids = tok.encode(split[0], add_special_tokens=False)
    det = IncrementalDetokenizer(tok, tok.encode("x"), SamplingParams())
    det.update(ids[:-1], stop_terminated=False)
    assert det.get_next_output_text(finished=False, delta=False) == ""
    det.finish()  # e.g. the length limit cut the character
    assert det.output_text == tok.decode(ids[:-1])


def test_skip_special_tokens_controls_special_token_text(tok):
    ids = tok.encode("hello", add_special_tokens=False) + [tok.eos_token_id]
    det, _, _ = _run(tok, [tok.bos_token_id], ids)
    assert det.output_text == "hello"
    det, _, _ = _run(tok, [tok.bos_token_id], ids, skip_special_tokens=False)
    assert det.output_text == tok.decode(ids, skip_special_tokens=False)
    assert det.output_text.startswith("hello") and len(det.output_text) > len("hello")


def test_stop_token_is_hidden_from_text_unless_included(tok):
    ids = tok.encode("hello world", add_special_tokens=False)
    det = IncrementalDetokenizer(tok, [1], SamplingParams(skip_special_tokens=False))
    assert det.update(ids, stop_terminated=True) is None
    assert det.output_token_ids == ids
    assert det.output_text == tok.decode(ids[:-1])


@pytest.mark.parametrize("chunk", [1, 4])
def test_stop_string_spanning_tokens_truncates_and_reports(tok, chunk):
    text = "The quick brown fox jumps over the lazy dog"
    ids = tok.encode(text, add_special_tokens=False)
    det, stop, streamed = _run(tok, [1], ids, chunk=chunk, stop=["fox jum", "zzz"])
    assert stop == "fox jum"
    assert det.output_text == "The quick brown " == streamed
    # No token after the one that completed the stop string is kept.
    assert tok.decode(det.output_token_ids).startswith("The quick brown fox jum")
    assert not tok.decode(det.output_token_ids[:-1]).startswith("The quick brown fox jum")


def test_include_stop_str_in_output_keeps_the_stop_string(tok):
    ids = tok.encode("数据并行和张量并行", add_special_tokens=False)
    det, stop, streamed = _run(tok, [1], ids, stop=["并行和"], include_stop_str_in_output=True)
    assert stop == "并行和"
    assert det.output_text == "数据并行和" == streamed


def test_streamed_text_never_shows_a_stop_string_prefix(tok):
    text = "The quick brown fox jumps over"
    ids = tok.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(tok, [1], SamplingParams(stop=["brown fox"]))
    seen = []
    for t in ids:
        stop = det.update([t], stop_terminated=False)
        seen.append(det.get_next_output_text(finished=stop is not None, delta=False))
        if stop:
            break
    assert seen[-1] == "The quick "
    assert all("brown"[:3] not in s for s in seen)


def test_earliest_stop_string_wins_and_min_tokens_defers_stop(tok):
    ids = tok.encode("one two three four", add_special_tokens=False)
    det, stop, _ = _run(tok, [1], ids, chunk=len(ids), stop=["four", "two"])
    assert stop == "two" and det.output_text == "one "
    # With min_tokens covering the whole text, no stop string can fire.
    det, stop, _ = _run(tok, [1], ids, stop=["two"], min_tokens=len(ids), max_tokens=99)
    assert stop is None and det.output_text == "one two three four"


def test_without_tokenizer_only_token_ids_are_tracked():
    det = IncrementalDetokenizer(None, [1, 2], SamplingParams(stop=["x"]))
    assert det.update([5, 6, 7], stop_terminated=False) is None
    det.finish()
    assert det.output_token_ids == [5, 6, 7] and det.output_text == ""


class _MetaspaceWrapper(_WrappedTokenizer):
    """SentencePiece-style tokenizer ("▁" marks a space; decode strips the first one)."""

    def __init__(self) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Sequence([
            decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ])
        trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"],
                                      show_progress=False)
        tok.train_from_iterator(CORPUS * 3, trainer)
        # Byte pieces are ordinary vocabulary entries (as in Llama/Mistral), not specials.
        spec = json.loads(tok.to_str())
        vocab = spec["model"]["vocab"]
        for b in range(256):
            vocab.setdefault(f"<0x{b:02X}>", len(vocab))
        spec["model"]["byte_fallback"] = True
        tok = Tokenizer.from_str(json.dumps(spec))
        self._tok = tok
        self.bos_token_id = tok.token_to_id("<s>")
        self.eos_token_id = tok.token_to_id("</s>")
        self.all_special_ids = [tok.token_to_id("<unk>"), self.bos_token_id, self.eos_token_id]
        self.vocab_size = tok.get_vocab_size()


def test_sentencepiece_style_leading_spaces_survive_incremental_decoding():
    tok = _MetaspaceWrapper()
    prompt = tok.encode("The quick")
    text = " brown fox jumps over the lazy dog"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text.lstrip()  # decoding alone loses the leading space
    det, _, streamed = _run(tok, prompt, ids)
    assert det.output_text == streamed == text
    # Byte-fallback pieces (<0xE6> ...) of characters outside the vocabulary.
    ids = tok.encode(" " + MIXED + " 🦀", add_special_tokens=False)
    det, _, streamed = _run(tok, prompt, ids)
    assert det.output_text == streamed == " " + MIXED + " 🦀"
