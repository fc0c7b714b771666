"""The seam of a migrated stream (proxy/migrate.py), with the tiny model's byte-level tokenizer
and the engine's own incremental detokenizer: a D that dies between the tokens of one
multi-byte character leaves the client no half character and no missing or repeated text, and
a continuation leg's events read as the same answer (chat deltas, usage over the whole answer).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from engine.frontend.detokenizer import IncrementalDetokenizer
from engine.models.tokenizer import Tokenizer
from engine.protocol import SamplingParams
from proxy.migrate import Plan, note_event, rewrite_event

_REPLACEMENT = "\ufffd"


def _engine_events(tok: Tokenizer, prompt: list[int], out: list[int]) -> list[dict[str, Any]]:
    """What a D streams for `out`, one token per event, with return_token_ids."""
    det = IncrementalDetokenizer(tok, prompt, SamplingParams(max_tokens=len(out)))
    events = []
    for i, t in enumerate(out):
        det.update([t], False)
        choice: dict[str, Any] = {"index": 0, "text": det.get_next_output_text(False, True),
                                  "token_ids": [t], "finish_reason": None}
        if i == 0:
            choice["prompt_token_ids"] = prompt
        events.append({"id": "cmpl-a", "object": "text_completion", "created": 7,
                       "model": "m", "choices": [choice]})
    return events


def _continuation_text(tok: Tokenizer, prompt: list[int], out: list[int]) -> str:
    det = IncrementalDetokenizer(tok, prompt, SamplingParams(max_tokens=len(out) or 1))
    det.update(out, False)
    det.finish()
    return det.get_next_output_text(True, True)


def _split_character(tok: Tokenizer) -> tuple[list[int], int]:
    """An answer's ids and a cut inside one of its multi-byte characters."""
    for text in ("ka 😀 lo", "the 한국 cache", "zen 中文 block", "el café ta"):
        ids = tok.encode(text, add_special_tokens=False)
        for k in range(1, len(ids)):
            if tok.decode(ids[:k]).endswith(_REPLACEMENT):
                return ids, k
    pytest.fail("the tiny tokenizer splits none of the candidate characters")


def test_a_character_split_at_the_seam_arrives_whole_once(tiny_model):
    tok = Tokenizer.from_dir(tiny_model)
    prompt = tok.encode("the model decode", add_special_tokens=False)
    out, cut = _split_character(tok)
    events = _engine_events(tok, prompt, out)
    plan = Plan(client_ids=False)
    shown = []
    for event in events[:cut]:  # D dies after relaying `cut` tokens
        note_event(plan, event)
        shown.append(event["choices"][0]["text"])
        assert "token_ids" not in event["choices"][0]
        assert "prompt_token_ids" not in event["choices"][0]
    assert plan.prompt_ids == prompt
    assert plan.pending, "the cut is inside a character: its first bytes' ids are pending"
    assert plan.sent + plan.pending == out[:cut]
    continuation = _continuation_text(tok, prompt + plan.sent, out[len(plan.sent):])
    assert "".join(shown) + continuation == tok.decode(out)
    assert _REPLACEMENT not in "".join(shown) + continuation
    # counting the pending ids as sent (continuing after them) loses the character
    naive = _continuation_text(tok, prompt + out[:cut], out[cut:])
    assert "".join(shown) + naive != tok.decode(out)


def test_ids_reach_a_client_that_asked_for_them():
    plan = Plan(client_ids=True)
    event = {"id": "c", "created": 1, "model": "m", "prompt_token_ids": [5, 6],
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    note_event(plan, event)
    assert event["prompt_token_ids"] == [5, 6] and plan.prompt_ids == [5, 6]
    event = {"choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": [9]}]}
    note_event(plan, event)
    assert event["choices"][0]["token_ids"] == [9] and plan.sent == [9]


def test_a_continuation_event_reads_as_the_clients_chat_answer():
    plan = Plan(client_ids=False, prompt_ids=[1, 2, 3, 4, 5], sent=[7, 8, 9], base=3, legs=1,
                head={"id": "chatcmpl-a", "created": 7, "model": "m"})
    event = {"id": "cmpl-b", "object": "text_completion", "created": 9, "model": "m",
             "choices": [{"index": 0, "text": " lo", "token_ids": [11],
                          "prompt_token_ids": [1, 2, 3, 4, 5, 7, 8, 9],
                          "finish_reason": "length", "stop_reason": None}]}
    note_event(plan, event)
    chat = rewrite_event(copy.deepcopy(event), plan, chat=True)
    assert chat["id"] == "chatcmpl-a" and chat["created"] == 7
    assert chat["object"] == "chat.completion.chunk"
    assert chat["choices"] == [{"index": 0, "delta": {"content": " lo"}, "logprobs": None,
                                "finish_reason": "length", "stop_reason": None}]
    usage_event = {"id": "cmpl-b", "created": 9, "model": "m", "choices": [],
                   "usage": {"prompt_tokens": 8, "completion_tokens": 4, "total_tokens": 12}}
    out = rewrite_event(usage_event, plan, chat=False)
    assert out["id"] == "chatcmpl-a"
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
