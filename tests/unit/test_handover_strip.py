"""proxy/handover: the cut of D's seeded first token out of D's first chunk (D's frontend may
coalesce tokens 1..k into one chunk behind a slow reader), and when P's token goes first."""

from __future__ import annotations

import pytest

from proxy.handover import client_limit, eligible, ends_on_first, stop_hold
from proxy.handover_leg import strip_first


def _completion(text: str, tokens: list[str], ids: list[int], finish=None) -> dict:
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return {"id": "x", "object": "text_completion", "created": 1, "model": "m", "choices": [{
        "index": 0, "text": text, "token_ids": ids, "prompt_token_ids": [1, 2],
        "logprobs": {"text_offset": offsets, "token_logprobs": [-0.5] * len(tokens),
                     "tokens": tokens, "top_logprobs": [{t: -0.5} for t in tokens]},
        "finish_reason": finish, "stop_reason": None}]}


def test_a_coalesced_completion_chunk_loses_token_1_only():
    out = strip_first(_completion("ab cd", ["ab", " cd"], [7, 8]), False, "ab")
    choice = out["choices"][0]
    assert choice["text"] == " cd" and choice["token_ids"] == [8]
    assert choice["logprobs"] == {"text_offset": [2], "token_logprobs": [-0.5],
                                  "tokens": [" cd"], "top_logprobs": [{" cd": -0.5}]}
    assert "prompt_token_ids" not in choice  # P's head carried them


def test_token_1_alone_is_dropped_but_a_finish_stays():
    assert strip_first(_completion("ab", ["ab"], [7]), False, "ab") is None
    out = strip_first(_completion("ab", ["ab"], [7], finish="length"), False, "ab")
    assert out["choices"][0]["text"] == "" and out["choices"][0]["finish_reason"] == "length"


def test_a_coalesced_chat_chunk_loses_token_1_only():
    chunk = {"choices": [{"index": 0, "delta": {"content": "hi there"}, "logprobs": {
        "content": [{"token": "hi"}, {"token": " there"}]}, "finish_reason": None}]}
    out = strip_first(chunk, True, "hi")
    assert out["choices"][0]["delta"] == {"content": " there"}
    assert out["choices"][0]["logprobs"] == {"content": [{"token": " there"}]}
    alone = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}
    assert strip_first(alone, True, "hi") is None


def test_a_decode_that_did_not_continue_prefill_is_refused():
    with pytest.raises(ValueError, match="not prefill's"):
        strip_first(_completion("zz", ["zz"], [9]), False, "ab")


def test_what_colocated_holds_back_and_what_ends_on_token_1():
    assert stop_hold({}) == 0 and stop_hold({"stop": "x"}) == 0
    assert stop_hold({"stop": ["ab", "xyz"]}) == 2
    assert stop_hold({"stop": ["xyz"], "include_stop_str_in_output": True}) == 0
    assert client_limit("completions", {}) == 16
    assert client_limit("chat", {"max_tokens": 5, "max_completion_tokens": 1}) == 1
    assert ends_on_first("chat", {"max_completion_tokens": 1}, "length")
    assert ends_on_first("completions", {"max_tokens": 8}, "stop")
    assert not ends_on_first("completions", {"max_tokens": 8}, "length")
    assert not ends_on_first("chat", {}, "length")
    assert eligible("completions", {"prompt": "hi"})
    assert eligible("completions", {"prompt": [1, 2]})
    assert not eligible("completions", {"prompt": ["a", "b"]})
    assert not eligible("completions", {"prompt": "hi", "n": 2})
    assert not eligible("chat", {"kv_transfer_params": {"first_token": False}})
    assert not eligible("chat", {"tools": [{"type": "function"}]})
    # what P's leg replaces is judged by D alone: a value the engine refuses is D's to answer
    # (CI: `max_tokens: true` got P's one-token answer, 200, when P answered before D's 400)
    for field, bad in (("max_tokens", True), ("max_tokens", 0), ("max_tokens", 1.0),
                       ("max_completion_tokens", True), ("min_tokens", False),
                       ("min_tokens", -1), ("n", True), ("best_of", True), ("n", "1"),
                       ("stream", 1), ("stream", "maybe"), ("stream_options", {})):
        assert not eligible("completions", {"prompt": "hi", field: bad}), (field, bad)
    assert eligible("completions", {"prompt": "hi", "max_tokens": 1, "min_tokens": 0,
                                    "n": 1, "best_of": 1})
    assert eligible("chat", {"max_completion_tokens": 3, "max_tokens": None})
    assert eligible("chat", {"stream": True, "stream_options": {"include_usage": True}})
