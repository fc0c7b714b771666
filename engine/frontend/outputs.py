"""What users get back: RequestOutput with one CompletionOutput per sample (vLLM names).

These objects live in the API-server / offline process only; they never cross a socket.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.protocol import Logprobs

# Per generated position: token id -> logprob (sampled token first, then the top-N).
SampleLogprobs = list[dict[int, float]]


@dataclass
class CompletionOutput:
    """One sample of a request. In DELTA mode text/token_ids/logprobs hold only what is new."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge_delta(self, newer: CompletionOutput) -> None:
        """Append a later delta of the same sample; the latest finish state wins."""
        self.text += newer.text
        self.token_ids = self.token_ids + newer.token_ids
        if newer.logprobs is not None:
            self.logprobs = (self.logprobs or []) + newer.logprobs
        self.cumulative_logprob = newer.cumulative_logprob
        self.finish_reason = newer.finish_reason
        self.stop_reason = newer.stop_reason


@dataclass
class RequestOutput:
    """The state of one user request. `request_id` is the id the user gave (external)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    error: str | None = None  # set when the engine failed this request
    metrics: dict[str, float] = field(default_factory=dict)
    # with SamplingParams.prompt_logprobs: one entry per prompt token, None for the first
    # (nothing predicts it); each the prompt token's logprob, its rank, then the top-N
    prompt_logprobs: list[Logprobs | None] | None = None

    def add(self, newer: RequestOutput, aggregate: bool) -> None:
        """Fold a later output of the same request into this one (consumer lagging).

        aggregate=True (DELTA): samples with the same index are concatenated.
        aggregate=False (CUMULATIVE / FINAL_ONLY): samples with the same index are replaced.
        Samples not seen before are added; outputs stay sorted by index.
        """
        by_index = {c.index: c for c in self.outputs}
        for comp in newer.outputs:
            old = by_index.get(comp.index)
            if old is not None and aggregate:
                old.merge_delta(comp)
            else:
                by_index[comp.index] = comp
        self.outputs = [by_index[i] for i in sorted(by_index)]
        self.finished = newer.finished
        self.num_cached_tokens = newer.num_cached_tokens
        if newer.kv_transfer_params is not None:
            self.kv_transfer_params = newer.kv_transfer_params
        if newer.error is not None:
            self.error = newer.error
        self.metrics = newer.metrics or self.metrics
        if newer.prompt_logprobs is not None:
            self.prompt_logprobs = newer.prompt_logprobs
