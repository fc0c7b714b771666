"""InputProcessor: prompt forms, internal ids, max_tokens resolution, errors naming fields."""

from __future__ import annotations

import re

import pytest

from engine.frontend.input_processor import InputProcessor
from engine.protocol import SamplingParams

BOS, EOS, VOCAB = 98, 99, 100


class CharTokenizer:
    """a..z -> 0..25; encode adds BOS when asked."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [ord(c) - ord("a") for c in text]
        return [BOS] + ids if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i) for i in ids if i < 26)


@pytest.fixture
def proc() -> InputProcessor:
    return InputProcessor(CharTokenizer(), max_model_len=32, eos_token_id=EOS, vocab_size=VOCAB)


def test_string_prompt_is_tokenized_with_special_tokens(proc):
    req, text = proc.process("user-1", "abc", SamplingParams(max_tokens=4))
    assert req.prompt_token_ids == [BOS, 0, 1, 2]
    assert text == "abc"
    assert req.eos_token_id == EOS
    assert re.fullmatch(r"user-1-[0-9a-f]{8}", req.request_id)
    assert req.arrival_time > 0


def test_all_prompt_forms_are_accepted(proc):
    p = SamplingParams(max_tokens=2)
    assert proc.process("a", {"prompt_token_ids": [5, 6]}, p)[0].prompt_token_ids == [5, 6]
    req, text = proc.process("b", {"prompt": "ab"}, p)
    assert req.prompt_token_ids == [BOS, 0, 1] and text == "ab"
    req, text = proc.process("c", [7, 8, 9], p)
    assert req.prompt_token_ids == [7, 8, 9] and text is None


def test_internal_ids_are_unique_for_a_reused_external_id(proc):
    ids = {proc.process("same", "a", SamplingParams(max_tokens=1))[0].request_id
           for _ in range(50)}
    assert len(ids) == 50


def test_max_tokens_none_fills_the_context_without_touching_caller_params(proc):
    params = SamplingParams(max_tokens=None)
    req, _ = proc.process("r", [1, 2, 3], params)
    assert req.sampling_params.max_tokens == 32 - 3
    assert params.max_tokens is None
    assert proc.process("r", [1] * 31, SamplingParams(max_tokens=1))[0].sampling_params \
        .max_tokens == 1


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ("", SamplingParams(), "prompt"),
        ([], SamplingParams(), "prompt"),
        ({"prompt_token_ids": []}, SamplingParams(), "prompt"),
        ({"nothing": 1}, SamplingParams(), "prompt"),
        (3.5, SamplingParams(), "prompt"),
        ([1, VOCAB], SamplingParams(), "prompt_token_ids"),
        ([1, -1], SamplingParams(), "prompt_token_ids"),
        ([1, "x"], SamplingParams(), "prompt_token_ids"),
        ([1] * 32, SamplingParams(max_tokens=1), "max_model_len"),
        ([1] * 20, SamplingParams(max_tokens=13), "max_tokens"),
        ([1], SamplingParams(stop_token_ids=[VOCAB + 5]), "stop_token_ids"),
    ],
)
def test_invalid_input_raises_value_error_naming_the_field(proc, prompt, params, field):
    with pytest.raises(ValueError) as err:
        proc.process("bad", prompt, params)
    assert field in str(err.value)


def test_prompt_too_long_message_names_prompt_and_limit(proc):
    msg = r"prompt \(length 40 tokens\) is longer than max_model_len"
    with pytest.raises(ValueError, match=msg):
        proc.process("x", [1] * 40, SamplingParams())


def test_generation_defaults_apply_when_no_params_given():
    proc = InputProcessor(CharTokenizer(), 64, EOS, VOCAB,
                          generation_defaults={"temperature": 0.6, "top_p": 0.9})
    req, _ = proc.process("d", "ab", None)
    assert req.sampling_params.temperature == 0.6 and req.sampling_params.top_p == 0.9
    explicit, _ = proc.process("e", "ab", SamplingParams(temperature=1.0, max_tokens=3))
    assert explicit.sampling_params.temperature == 1.0
    with pytest.raises(ValueError, match="top_p"):
        InputProcessor(CharTokenizer(), 64, EOS, VOCAB, generation_defaults={"top_p": 7})


def test_without_tokenizer_only_token_ids_are_accepted():
    proc = InputProcessor(None, 16, None, VOCAB)
    req, _ = proc.process("t", [1, 2], SamplingParams(max_tokens=2))
    assert req.eos_token_id is None
    with pytest.raises(ValueError, match="prompt"):
        proc.process("t", "abc", SamplingParams())


def test_kv_transfer_params_and_arrival_time_are_carried(proc):
    kv = {"do_remote_decode": True, "transfer_id": "t-1"}
    req, _ = proc.process("k", [1, 2], SamplingParams(max_tokens=1), arrival_time=12.5,
                          kv_transfer_params=kv)
    assert req.kv_transfer_params == kv and req.arrival_time == 12.5


def test_external_id_is_recovered_from_internal_id(proc):
    from engine.frontend.input_processor import external_request_id

    req, _ = proc.process("cmpl-a-b", "a", SamplingParams(max_tokens=1))
    assert external_request_id(req.request_id) == "cmpl-a-b"
    assert external_request_id("plain") == "plain"
    assert external_request_id("x-NOTHEX12") == "x-NOTHEX12"


@pytest.mark.parametrize("external", ["HB:x", "PUSH_REG:", "a,b", "50%3A", "HB", "x:y,z%"])
def test_internal_ids_never_hold_notification_separators_and_are_unique(proc, external):
    from engine.frontend.input_processor import external_request_id

    a, _ = proc.process(external, [1, 2], SamplingParams(max_tokens=1))
    b, _ = proc.process(external, [1, 2], SamplingParams(max_tokens=1))
    assert a.request_id != b.request_id
    assert ":" not in a.request_id and "," not in a.request_id
    assert a.request_id[:-9] == b.request_id[:-9]  # what P and D pair by without transfer id
    assert external_request_id(a.request_id) == external
