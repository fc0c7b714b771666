"""InputProcessor: user prompt + SamplingParams -> validated, tokenized EngineCoreRequest.

Runs in the API-server / offline process, before anything reaches the core. Every rejection
is a ValueError whose message names the offending field, so the HTTP layer can answer 400
with `param` set, and nothing half-validated is ever queued.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from engine.protocol import EngineCoreRequest, SamplingParams, now

PromptType = str | Mapping[str, Any] | list[int]


# Separators of the KV notification formats: an internal id never holds them, so no
# client-chosen id can read as another message (`HB:x`, `PUSH_REG:...`) or split a heartbeat.
_ESCAPES = {"%": "%25", ":": "%3A", ",": "%2C"}
_UNESCAPES = {v: k for k, v in _ESCAPES.items()}
_ESCAPED = re.compile("|".join(re.escape(k) for k in _ESCAPES))
_UNESCAPED = re.compile("|".join(re.escape(k) for k in _UNESCAPES))
_SURROGATE = re.compile("[\ud800-\udfff]")


def make_internal_request_id(external_id: str) -> str:
    """The core's id: the caller's id, with '%', ':' and ',' percent-escaped, plus '-' and 8
    random hex characters. Unique even when callers reuse ids; the same caller's id gives the
    same text before the suffix on every engine, so KV peers strip the suffix to pair a
    prefill with its decode (vLLM's push protocol), and it is never a notification tag."""
    escaped = _ESCAPED.sub(lambda m: _ESCAPES[m.group(0)], external_id)
    return f"{escaped}-{secrets.token_hex(4)}"


def external_request_id(internal_id: str) -> str:
    """Inverse of make_internal_request_id: drop a trailing "-" + 8 hex characters and undo
    the escapes."""
    head, sep, tail = internal_id.rpartition("-")
    if sep and len(tail) == 8 and all(c in "0123456789abcdef" for c in tail):
        return _UNESCAPED.sub(lambda m: _UNESCAPES[m.group(0)], head)
    return internal_id


def encode_prompt(tokenizer: Any, text: str, *, release_gil: bool = False) -> list[int]:
    """A text prompt's token ids, as every engine makes them (and a proxy that tokenizes once
    for both legs, proxy/routing.py). `release_gil`: encode through the batch call, which
    lets other threads run meanwhile (same ids; for a caller on a worker thread)."""
    if not text:
        raise ValueError("prompt must not be empty")
    bad = _SURROGATE.search(text)
    if bad is not None:  # the tokenizer would raise a TypeError: the caller's mistake
        raise ValueError(f"prompt is not valid Unicode: lone surrogate "
                         f"U+{ord(bad.group()):04X} at index {bad.start()}")
    if release_gil and hasattr(tokenizer, "encode_batch"):
        return list(tokenizer.encode_batch([text], add_special_tokens=True)[0])
    return list(tokenizer.encode(text, add_special_tokens=True))


# Text whose ids tell tokenizers apart: words, digits, punctuation, accents, CJK, an emoji,
# whitespace runs, code, and text shaped like special tokens.
_PROBE = ("Tokenizer probe: Hello, World! 12345 67.89 e\u0301 ü ß 日本語の文章 한국어 😀 \n\t  "
          "def f(x):\n    return x ** 2  # </s> <|im_end|> [INST] <s> ¿¡ -- ... ---")


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """16 hex characters that differ between two tokenizers that would give a prompt other
    ids or another chat rendering (vocabulary size, special ids, chat template, the ids of a
    probe text). A proxy that tokenizes once sends it with the ids; an engine whose own
    differs encodes the text itself (engine/server/serving.py)."""
    parts = [len(tokenizer), getattr(tokenizer, "bos_token_id", None),
             getattr(tokenizer, "eos_token_id", None), getattr(tokenizer, "chat_template", None),
             list(tokenizer.encode(_PROBE, add_special_tokens=True))]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


class InputProcessor:
    def __init__(
        self,
        tokenizer: Any | None,
        max_model_len: int,
        eos_token_id: int | None,
        vocab_size: int,
        generation_defaults: dict[str, Any] | None = None,
        kv_params_validator: Callable[[dict[str, Any], list[int]], None] | None = None,
    ) -> None:
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {max_model_len}")
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.generation_defaults = dict(generation_defaults or {})
        self.kv_params_validator = kv_params_validator
        if self.generation_defaults:
            SamplingParams(**self.generation_defaults)  # fail at start-up, not per request

    def default_sampling_params(self) -> SamplingParams:
        """Sampling params for a request that gave none: the model's generation defaults."""
        return SamplingParams(**self.generation_defaults)

    def tokenize(self, prompt: PromptType) -> tuple[list[int], str | None]:
        """Prompt -> (token ids, prompt text if known). Raises ValueError naming the field."""
        if isinstance(prompt, str):
            return self._encode(prompt), prompt
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, list):
                    raise ValueError("prompt_token_ids must be a list of integers")
                text = prompt.get("prompt")
                return list(ids), text if isinstance(text, str) else None
            if "prompt" in prompt:
                text = prompt["prompt"]
                if not isinstance(text, str):
                    raise ValueError("prompt must be a string")
                return self._encode(text), text
            raise ValueError("prompt must hold 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list):
            return list(prompt), None
        raise ValueError(
            f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}"
        )

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("prompt must be given as prompt_token_ids: no tokenizer loaded")
        return encode_prompt(self.tokenizer, text)

    def _validate_ids(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt must not be empty")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise ValueError(f"prompt_token_ids must be integers, got {t!r}")
            if not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"prompt_token_ids: token id {t} is out of vocabulary "
                    f"(size {self.vocab_size})"
                )
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt (length {len(ids)} tokens) is longer than max_model_len "
                f"({self.max_model_len}) allows: no room for a generated token"
            )

    def _resolve_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        room = self.max_model_len - prompt_len
        if params.max_tokens is None:
            params = msgspec.structs.replace(params, max_tokens=room)
        elif params.max_tokens > room:
            raise ValueError(
                f"max_tokens ({params.max_tokens}) plus the prompt ({prompt_len} tokens) "
                f"exceeds max_model_len ({self.max_model_len}); at most {room} allowed"
            )
        if params.min_tokens > params.max_tokens:
            raise ValueError(
                f"min_tokens ({params.min_tokens}) exceeds max_tokens ({params.max_tokens})"
            )
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(
                f"stop_token_ids: token id {bad[0]} is out of vocabulary (size {self.vocab_size})"
            )
        return params

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None,
        arrival_time: float | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        internal_request_id: str | None = None,
    ) -> tuple[EngineCoreRequest, str | None]:
        """Validate and tokenize. Returns the core request (request_id = internal id: the one
        given, else a fresh one) and the prompt text when known. The caller's SamplingParams
        object is never modified."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if params is None:
            params = self.default_sampling_params()
        ids, text = self.tokenize(prompt)
        self._validate_ids(ids)
        if kv_transfer_params is not None and self.kv_params_validator is not None:
            self.kv_params_validator(kv_transfer_params, ids)  # e.g. bound to this prompt
        params = self._resolve_params(params, len(ids))
        request = EngineCoreRequest(
            request_id=internal_request_id or make_internal_request_id(request_id),
            prompt_token_ids=ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=now() if arrival_time is None else arrival_time,
            kv_transfer_params=kv_transfer_params,
        )
        return request, text
