"""Engine logprobs (one `{token_id: logprob}` map per sampled position, holding the sampled
token and the top-N) → the two OpenAI shapes: the completions object (tokens /
token_logprobs / top_logprobs / text_offset) and the chat `logprobs.content` list.

JSON has no infinities: a -inf logprob is reported as -9999.0, as OpenAI and vLLM do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine.protocol import Logprobs
from engine.server.errors import APIError
from engine.server.openai_protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobsList,
    TopLogprob,
)

if TYPE_CHECKING:
    from engine.connector_api import ConnectorSpec

_FLOOR = -9999.0


def _finite(lp: float | None) -> float:
    if lp is None or math.isnan(lp):
        return _FLOOR
    return max(float(lp), _FLOOR)


def check_prompt_logprobs_leg(params: Any, kv_transfer_params: dict[str, Any] | None,
                              spec: ConnectorSpec | None) -> None:
    """Prompt logprobs come from the prefill's forward pass: a decode leg whose prompt KV
    arrives from another engine (the connector's spec says which params mean that) computes no
    prompt rows, so it is refused, never answered with holes (the proxy sends such requests to
    one engine that prefills them itself)."""
    if (params.prompt_logprobs is not None and spec is not None
            and spec.prefilled_elsewhere(kv_transfer_params)):
        raise APIError("prompt_logprobs (or echo with logprobs) cannot be computed on a decode "
                       "leg whose kv_transfer_params bring the prompt's KV from another engine: "
                       "the prompt is prefilled elsewhere", param="prompt_logprobs")


class TokenText:
    """Decodes single tokens for logprob display; caches because top-N repeat a lot."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            try:
                text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            except TypeError:
                text = self._tokenizer.decode([token_id])
            if len(self._cache) < 65536:
                self._cache[token_id] = text
        return text


def _ranked(entry: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -_finite(kv[1]))


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[dict[int, float]] | None,
    top_n: int,
    token_text: TokenText,
    initial_offset: int,
) -> CompletionLogprobs:
    """Logprobs for `token_ids` (new text starting at character `initial_offset`)."""
    out = CompletionLogprobs()
    offset = initial_offset
    entries = entries or []
    for i, tid in enumerate(token_ids):
        entry = entries[i] if i < len(entries) else {}
        text = token_text(tid)
        out.tokens.append(text)
        out.token_logprobs.append(_finite(entry.get(tid)))
        top: dict[str, float] = {}
        if top_n > 0:
            for cand, lp in _ranked(entry)[: top_n + 1]:
                top.setdefault(token_text(cand), _finite(lp))
        else:
            top[text] = _finite(entry.get(tid))
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def echoed_prompt_logprobs(
    prompt_ids: Sequence[int], entries: Sequence[Logprobs | None] | None, top_n: int,
    token_text: TokenText,
) -> CompletionLogprobs:
    """With `echo`, the prompt's tokens with their logprobs (from the prefill, engine/runner/
    prompt_logprobs.py); the first token has none (nothing predicts it), as in OpenAI's and
    vLLM's answers."""
    out = CompletionLogprobs()
    offset = 0
    entries = entries or []
    for i, tid in enumerate(prompt_ids):
        text = token_text(tid)
        entry = entries[i] if i < len(entries) else None
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        lp = _finite(entry.logprobs[0])
        out.token_logprobs.append(lp)
        top = {text: lp}
        for cand, value in zip(entry.token_ids[1:top_n + 1], entry.logprobs[1:top_n + 1],
                               strict=True):
            top.setdefault(token_text(cand), _finite(value))
        out.top_logprobs.append(top)
    return out


def vllm_prompt_logprobs(
    entries: Sequence[Logprobs | None] | None, top_n: int, token_text: TokenText
) -> PromptLogprobsList | None:
    """vLLM's `prompt_logprobs`: per prompt position None (the first) or {token id: {logprob,
    rank, decoded_token}} holding the prompt token and the top-N (ranks 1..N)."""
    if entries is None:
        return None
    out: PromptLogprobsList = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        tid = entry.token_ids[0]
        pos = {str(tid): PromptLogprob(logprob=_finite(entry.logprobs[0]),
                                       rank=entry.sampled_rank, decoded_token=token_text(tid))}
        for rank, (cand, value) in enumerate(
                zip(entry.token_ids[1:top_n + 1], entry.logprobs[1:top_n + 1], strict=True), 1):
            pos.setdefault(str(cand), PromptLogprob(logprob=_finite(value), rank=rank,
                                                    decoded_token=token_text(cand)))
        out.append(pos)
    return out


def merge_completion_logprobs(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        text_offset=a.text_offset + b.text_offset,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        tokens=a.tokens + b.tokens,
        top_logprobs=a.top_logprobs + b.top_logprobs,
    )


def chat_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[dict[int, float]] | None,
    top_n: int,
    token_text: TokenText,
) -> ChatLogprobs:
    content: list[ChatTokenLogprob] = []
    entries = entries or []
    for i, tid in enumerate(token_ids):
        entry = entries[i] if i < len(entries) else {}
        text = token_text(tid)
        tops = [
            TopLogprob(token=token_text(c), logprob=_finite(lp),
                       bytes=list(token_text(c).encode("utf-8")))
            for c, lp in _ranked(entry)[:top_n]
        ]
        content.append(ChatTokenLogprob(
            token=text, logprob=_finite(entry.get(tid)), bytes=list(text.encode("utf-8")),
            top_logprobs=tops,
        ))
    return ChatLogprobs(content=content)
