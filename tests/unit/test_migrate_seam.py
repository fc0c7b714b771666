"""The seam of a migrated stream (proxy/migrate.py), with the tiny model's byte-level tokenizer
and the engine's own incremental detokenizer: a D that dies between the tokens of one
multi-byte character leaves the client no half character and no missing or repeated text, and
a continuation leg's events read as the same answer (chat deltas, usage over the whole answer).
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
from migration_kit import merged_events

from engine.frontend.detokenizer import IncrementalDetokenizer
from engine.models.tokenizer import Tokenizer
from engine.protocol import SamplingParams
from proxy.migrate import Plan, held_ids, note_event, rewrite_event

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


def test_a_merged_chunk_with_text_and_a_held_byte_keeps_the_character(tiny_model):
    """CI caught this: D merged "…fi" and the first byte of the next character into one
    chunk; counting both ids as sent lost the character's U+FFFD at the seam."""
    tok = Tokenizer.from_dir(tiny_model)
    prompt = tok.encode("the model decode", add_special_tokens=False)

    async def decode(ids: list[int]) -> str:
        return tok.decode(ids)

    for text in ("ka 😀 lo", "the 한국 cache", "zen 中文 block", "el café ta", "a ☃ b"):
        out = tok.encode(text, add_special_tokens=False)
        for first in range(1, len(out)):
            events = merged_events(tok, prompt, out, first)
            for cut in range(1, len(events)):
                plan, shown = Plan(client_ids=False), []
                for event in events[:cut]:
                    note_event(plan, event)
                    shown.append(event["choices"][0]["text"])
                if plan.pending or plan.last_ids < 2 or not tok.decode(
                        plan.sent).endswith(_REPLACEMENT):
                    continue  # not the case: a text chunk whose last id D still held
                naive = _continuation_text(tok, prompt + plan.sent, out[len(plan.sent):])
                assert "".join(shown) + naive != tok.decode(out)
                held = asyncio.run(held_ids(plan.sent, plan.last_ids - 1, decode))
                assert held >= 1
                sent = plan.sent[:-held]
                continuation = _continuation_text(tok, prompt + sent, out[len(sent):])
                assert "".join(shown) + continuation == tok.decode(out)
                return
    pytest.fail("no candidate put text and a held byte in one chunk")


def test_held_ids_leaves_a_whole_seam_alone(tiny_model):
    tok = Tokenizer.from_dir(tiny_model)
    calls = []

    async def decode(ids: list[int]) -> str:
        calls.append(ids)
        return tok.decode(ids)

    ids = tok.encode("the cache block", add_special_tokens=False)
    assert asyncio.run(held_ids(ids, 3, decode)) == 0
    assert len(calls) == 1 and calls[0] == ids[-len(calls[0]):]
