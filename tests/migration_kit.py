"""What a D streams when its reader lags (for the migration seam's tests): the engine's own
detokenizer over `out`, with the collector's merging (text and ids of several steps in one
chunk) and vLLM's return_token_ids fields."""

from __future__ import annotations

from typing import Any

from engine.frontend.detokenizer import IncrementalDetokenizer
from engine.models.tokenizer import Tokenizer
from engine.protocol import SamplingParams


def merged_events(tok: Tokenizer, prompt: list[int], out: list[int],
                  first: int = 2) -> list[dict[str, Any]]:
    """One event for out[:first], then two tokens an event; the prompt's ids on the first."""
    det = IncrementalDetokenizer(tok, prompt, SamplingParams(max_tokens=len(out)))
    groups = [out[:first]] + [out[i:i + 2] for i in range(first, len(out), 2)]
    events = []
    for ids in groups:
        text = ""
        for t in ids:
            det.update([t], False)
            text += det.get_next_output_text(False, True)
        events.append({"id": "cmpl-lagging", "object": "text_completion", "created": 1,
                       "model": "m", "choices": [{"index": 0, "text": text, "logprobs": None,
                                                  "finish_reason": None, "token_ids": ids}]})
    events[0]["choices"][0]["prompt_token_ids"] = prompt
    return events
