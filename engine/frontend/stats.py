"""Request and iteration statistics gathered by the OutputProcessor (feeds Prometheus).

All times come from one clock (`engine.protocol.now`, monotonic, unless a test injects one);
arrival_time on the EngineCoreRequest is taken from the same clock by the InputProcessor.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestStateStats:
    """Per request, updated on every output from the core."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0

    @property
    def first_token_latency(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class FinishedRequestStats:
    request_id: str  # internal id
    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    first_token_latency: float | None
    # vLLM's request phases: queued (arrival -> first schedule, from the core), prefill (first
    # schedule -> first token), decode (first -> last token), inference (prefill + decode)
    queued_time: float = 0.0
    prefill_time: float = 0.0
    decode_time: float = 0.0

    @property
    def inference_time(self) -> float:
        return self.prefill_time + self.decode_time


@dataclass
class IterationStats:
    """What one `process_outputs` pass saw. Counts are per pass; the metrics layer sums."""

    iteration_timestamp: float
    engine_core_timestamp: float | None = None
    num_prompt_tokens: int = 0  # prompts that produced their first token in this pass
    num_generation_tokens: int = 0
    time_to_first_tokens_iter: list[float] = field(default_factory=list)
    inter_token_latencies_iter: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)

    @property
    def num_finished(self) -> int:
        return len(self.finished_requests)

    @property
    def e2e_latencies(self) -> list[float]:
        return [f.e2e_latency for f in self.finished_requests]

    def observe_tokens(
        self, stats: RequestStateStats, num_new_tokens: int, num_prompt_tokens: int
    ) -> None:
        """Account one output carrying `num_new_tokens` new tokens for one request."""
        if num_new_tokens <= 0:
            return
        now = self.iteration_timestamp
        if stats.first_token_time is None:
            stats.first_token_time = now
            self.num_prompt_tokens += num_prompt_tokens
            self.time_to_first_tokens_iter.append(now - stats.arrival_time)
        elif stats.last_token_time is not None:
            self.inter_token_latencies_iter.append(now - stats.last_token_time)
        stats.last_token_time = now
        stats.num_generation_tokens += num_new_tokens
        self.num_generation_tokens += num_new_tokens

    def observe_finished(
        self, request_id: str, stats: RequestStateStats, finish_reason: str,
        num_prompt_tokens: int, queued_time: float = 0.0,
    ) -> None:
        ttft = stats.first_token_latency
        queued = min(max(0.0, queued_time), ttft) if ttft is not None else max(0.0, queued_time)
        first, last = stats.first_token_time, stats.last_token_time
        self.finished_requests.append(FinishedRequestStats(
            request_id=request_id,
            finish_reason=finish_reason,
            e2e_latency=self.iteration_timestamp - stats.arrival_time,
            num_prompt_tokens=num_prompt_tokens,
            num_generation_tokens=stats.num_generation_tokens,
            first_token_latency=ttft,
            queued_time=queued,
            prefill_time=max(0.0, ttft - queued) if ttft is not None else 0.0,
            decode_time=max(0.0, last - first) if first is not None and last is not None else 0.0,
        ))
