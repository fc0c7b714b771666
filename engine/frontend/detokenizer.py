"""Incremental detokenization with stop strings, one instance per request (frontend only).

Text is produced with two offsets over a short window of token ids: the *prefix* window
[prefix, read) was already turned into text, and decoding [prefix, end) and removing the
prefix's text gives exactly the new text. Decoding a window with context (rather than the
new token alone) keeps tokenizers that treat a leading token specially (SentencePiece's
"▁" space, byte-level pieces) right.

Invariants:
- `output_text` never holds half a character: while the window's text ends in U+FFFD
  (a multi-byte UTF-8 character still incomplete) nothing is emitted and the offsets stay;
  `finish()` flushes whatever is left, so the final text equals decoding all output ids.
- A stop string ends the text: it is cut before the stop string (or after it with
  include_stop_str_in_output) and no token after the one that completed it is kept.
- While streaming, the last len(longest stop) - 1 characters are held back so a client
  never sees the start of a stop string that is later cut.
"""

from __future__ import annotations

from typing import Any, Protocol

from engine.protocol import SamplingParams

# Prompt tokens kept as decoding context for the first output tokens.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class DecodesTokens(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Token ids in, text out, with stop-string detection. Owned by one RequestState."""

    def __init__(
        self,
        tokenizer: DecodesTokens | Any | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = list(params.stop) if tokenizer is not None else []
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.token_ids: list[int] = []
        self.output_text = ""
        self._window: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        self._sent = 0  # characters already returned in DELTA mode
        longest = max((len(s) for s in self.stop), default=0)
        self._hold = 0 if self.include_stop_str_in_output else max(longest - 1, 0)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    def _decode(self, ids: list[int]) -> str:
        if not ids or self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_next(self, token_id: int) -> str:
        if self.tokenizer is None:
            return ""
        self._window.append(token_id)
        full = self._decode(self._window[self._prefix:])
        if len(full) <= len(self._prefix_text) or full.endswith(_REPLACEMENT):
            return ""  # nothing visible yet, or a character still incomplete
        new = full[len(self._prefix_text):]
        # Slide: the text just produced becomes the next prefix window.
        self._prefix, self._read = self._read, len(self._window)
        self._prefix_text = self._decode(self._window[self._prefix:self._read])
        del self._window[: self._prefix]
        self._read -= self._prefix
        self._prefix = 0
        return new

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Add the core's new tokens. Returns the stop string that ended the request, if any.

        stop_terminated: the core finished on a stop token (EOS or stop_token_ids); unless
        include_stop_str_in_output, that last token is kept in token_ids but not in the text.
        """
        if not new_token_ids:
            return None
        hidden = None
        if stop_terminated and not self.include_stop_str_in_output:
            new_token_ids, hidden = new_token_ids[:-1], new_token_ids[-1]
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            new_text = self._decode_next(token_id)
            self.output_text += new_text
            if self.stop and new_text and len(self.token_ids) > self.min_tokens:
                stop = self._check_stop(len(new_text))
                if stop is not None:
                    return stop
        if hidden is not None:
            self.token_ids.append(hidden)
        return None

    def _check_stop(self, new_chars: int) -> str | None:
        """Find the earliest stop string ending inside the last `new_chars` characters."""
        text = self.output_text
        best: tuple[int, str] | None = None
        for stop in self.stop:
            start = max(0, len(text) - new_chars - len(stop) + 1)
            idx = text.find(stop, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        self.output_text = text[: idx + len(stop) if self.include_stop_str_in_output else idx]
        return stop

    def finish(self) -> None:
        """The request ended: flush text still held for an incomplete character."""
        if self.tokenizer is None or self._read == len(self._window):
            return
        full = self._decode(self._window[self._prefix:])
        if len(full) > len(self._prefix_text):
            self.output_text += full[len(self._prefix_text):]
        self._prefix_text = full
        self._read = len(self._window)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """All text so far (delta=False) or what is new since the last call (delta=True),
        holding back a possible stop-string prefix until the request finishes."""
        end = len(self.output_text) if finished else max(len(self.output_text) - self._hold, 0)
        if not delta:
            return self.output_text[:end]
        if end <= self._sent:
            return ""
        text = self.output_text[self._sent:end]
        self._sent = end
        return text
