"""RequestState: the frontend's memory of one core request (detokenizer, logprobs, stats).

Owned by the OutputProcessor; touched only from the thread / event loop that calls
`process_outputs`. One state per core request: an n > 1 request has one per child.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.frontend.detokenizer import IncrementalDetokenizer
from engine.frontend.outputs import CompletionOutput, RequestOutput, SampleLogprobs
from engine.frontend.stats import RequestStateStats
from engine.protocol import (
    EngineCoreRequest,
    FinishReason,
    Logprobs,
    RequestOutputKind,
)

if TYPE_CHECKING:
    from engine.frontend.collector import RequestOutputCollector
    from engine.frontend.parent_request import ParentRequest


class RequestState:
    def __init__(
        self,
        request: EngineCoreRequest,
        external_req_id: str,
        prompt: str | None,
        tokenizer: Any | None,
        parent: ParentRequest | None,
        request_index: int,
        queue: RequestOutputCollector | None,
    ) -> None:
        params = request.sampling_params
        self.request_id = request.request_id
        self.external_req_id = external_req_id
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.output_kind = params.output_kind
        self.parent = parent
        self.request_index = request_index
        self.queue = queue
        self.detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids, params)
        self.wants_logprobs = params.logprobs is not None
        self.logprobs: SampleLogprobs = []
        self.cumulative_logprob = 0.0
        self.num_cached_tokens = 0
        self.kv_transfer_params: dict[str, Any] | None = None
        self.prompt_logprobs: list[Logprobs | None] | None = None  # once the prefill is done
        self.stats = RequestStateStats(arrival_time=request.arrival_time)
        # Prompt tokens are counted once per user request, not once per n>1 child.
        self.counts_prompt = parent is None or request_index == 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def update(
        self,
        new_token_ids: list[int],
        new_logprobs: list[Logprobs] | None,
        finish_reason: FinishReason | None,
    ) -> tuple[list[int], SampleLogprobs | None, str | None]:
        """Detokenize the new tokens and convert their logprobs.

        Returns (tokens kept, their logprobs, stop string that ended the request). Tokens
        after a stop string are dropped, so `kept` may be shorter than `new_token_ids`.
        """
        det = self.detokenizer
        before = det.num_output_tokens
        stop = det.update(new_token_ids, finish_reason == FinishReason.STOP)
        kept = new_token_ids[: det.num_output_tokens - before]
        if stop is None and finish_reason is not None:
            det.finish()
        new_lps: SampleLogprobs | None = None
        if self.wants_logprobs:
            new_lps = []
            for lp in (new_logprobs or [])[: len(kept)]:
                new_lps.append(dict(zip(lp.token_ids, lp.logprobs, strict=True)))
                self.cumulative_logprob += lp.logprobs[0]
            self.logprobs.extend(new_lps)
        return kept, new_lps, stop

    def make_completion_output(
        self,
        kept_token_ids: list[int],
        new_logprobs: SampleLogprobs | None,
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
    ) -> CompletionOutput | None:
        """This update as the user sees it, or None when the output kind says to wait."""
        finished = finish_reason is not None
        if not finished and self.output_kind == RequestOutputKind.FINAL_ONLY:
            return None
        delta = self.output_kind == RequestOutputKind.DELTA
        text = self.detokenizer.get_next_output_text(finished, delta)
        if delta:
            token_ids = list(kept_token_ids)
            logprobs = new_logprobs
        else:
            token_ids = list(self.detokenizer.output_token_ids)
            logprobs = list(self.logprobs) if self.wants_logprobs else None
        return CompletionOutput(
            index=self.request_index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob if self.wants_logprobs else None,
            logprobs=logprobs,
            finish_reason=str(finish_reason) if finished else None,
            stop_reason=stop_reason if finished else None,
        )

    def make_request_output(
        self,
        outputs: list[CompletionOutput],
        finished: bool,
        kv_transfer_params: dict[str, Any] | None,
        error: str | None,
    ) -> RequestOutput:
        s = self.stats
        metrics = {"arrival_time": s.arrival_time}
        if s.first_token_time is not None:
            metrics["first_token_time"] = s.first_token_time
            metrics["last_token_time"] = s.last_token_time or s.first_token_time
        return RequestOutput(
            request_id=self.external_req_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=self.num_cached_tokens,
            kv_transfer_params=kv_transfer_params,
            error=error,
            metrics=metrics,
            prompt_logprobs=self.prompt_logprobs,
        )
