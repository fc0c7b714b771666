"""OutputProcessor: EngineCoreOutputs (token ids) -> RequestOutputs (text), in one pass.

Lives in the API-server / offline process. Not thread-safe: one caller (LLMEngine.step or
AsyncLLM's output-handler task) drives add_request / process_outputs / abort_requests.

Per core output, in a single loop over the batch: stats -> detokenize + stop strings ->
logprobs -> RequestOutput, delivered to the request's collector (AsyncLLM) or returned
(LLMEngine). n > 1 children are folded into their parent's output at the end of the pass.
A request the detokenizer finished on a stop string is still running in the core: its
internal id is returned in `reqs_to_abort` and the caller must abort it there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from engine.frontend.collector import RequestOutputCollector
from engine.frontend.input_processor import external_request_id
from engine.frontend.outputs import RequestOutput
from engine.frontend.parent_request import ParentRequest
from engine.frontend.request_state import RequestState
from engine.frontend.stats import IterationStats
from engine.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason, now

__all__ = [
    "OutputProcessor", "OutputProcessorOutput", "ParentRequest", "RequestOutputCollector",
]

_DEFAULT_ERROR = "the engine failed this request"


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput] = field(default_factory=list)  # requests w/o queue
    reqs_to_abort: list[str] = field(default_factory=list)  # internal ids, still in the core
    iteration_stats: IterationStats | None = None


class OutputProcessor:
    def __init__(
        self, tokenizer: Any | None, log_stats: bool = True, clock: Callable[[], float] = now
    ) -> None:
        self.tokenizer = tokenizer
        self.log_stats = log_stats
        self.clock = clock
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}
        self.external_req_ids: dict[str, list[str]] = {}  # external id -> internal ids

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        parent_req: ParentRequest | None = None,
        request_index: int = 0,
        queue: RequestOutputCollector | None = None,
        external_req_id: str | None = None,
    ) -> None:
        """Register a core request (a child, for n > 1) before it is sent to the core.

        external_req_id defaults to the parent's, else to the internal id without its
        8-hex suffix. `queue` set: outputs go to it (AsyncLLM); unset: they are returned."""
        req_id = request.request_id
        if req_id in self.request_states:
            raise ValueError(f"request {req_id} is already registered in the output processor")
        if external_req_id is None:
            external_req_id = (parent_req.external_req_id if parent_req is not None
                               else external_request_id(req_id))
        self.request_states[req_id] = RequestState(
            request, external_req_id, prompt, self.tokenizer, parent_req, request_index, queue
        )
        if parent_req is not None:
            self.parent_requests[parent_req.request_id] = parent_req
        self.external_req_ids.setdefault(external_req_id, []).append(req_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def process_outputs(
        self,
        engine_core_outputs: list[EngineCoreOutput],
        engine_core_timestamp: float | None = None,
    ) -> OutputProcessorOutput:
        """One pass over a batch of core outputs (see module docstring). Outputs for ids
        not registered here (aborted or finished already) are ignored."""
        result = OutputProcessorOutput()
        stats = None
        if self.log_stats:
            stats = IterationStats(self.clock(), engine_core_timestamp)
            result.iteration_stats = stats
        touched: dict[str, tuple[ParentRequest, RequestState]] = {}
        for out in engine_core_outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue  # already aborted or finished here; the core may lag behind
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            if out.num_cached_tokens:
                state.num_cached_tokens = out.num_cached_tokens
            if out.kv_transfer_params is not None:
                state.kv_transfer_params = out.kv_transfer_params  # sticky until delivered
            if out.prompt_logprobs is not None:
                state.prompt_logprobs = [None, *out.prompt_logprobs]
            kept, new_lps, stop_str = state.update(
                out.new_token_ids, out.new_logprobs, finish_reason
            )
            if stop_str is not None:
                finish_reason, stop_reason = FinishReason.STOP, stop_str
            if stats is not None:
                stats.observe_tokens(
                    state.stats, len(kept), state.num_prompt_tokens if state.counts_prompt else 0
                )
            error = None
            if finish_reason == FinishReason.ERROR:
                error = out.error or _DEFAULT_ERROR
            comp = state.make_completion_output(kept, new_lps, finish_reason, stop_reason)
            finished = finish_reason is not None
            parent = state.parent
            if parent is not None:
                parent.record(state.request_id, comp, finished, state.kv_transfer_params,
                              state.num_cached_tokens, error)
                if state.prompt_logprobs is not None:  # every child's prompt is the same
                    parent.prompt_logprobs = state.prompt_logprobs
                touched[parent.request_id] = (parent, state)
            elif comp is not None:
                self._deliver(state, state.make_request_output(
                    [comp], finished, state.kv_transfer_params, error), result)
            if finished:
                self._finish(state)
                if not out.finished:
                    result.reqs_to_abort.append(state.request_id)
                if stats is not None:
                    stats.observe_finished(state.request_id, state.stats, str(finish_reason),
                                           state.num_prompt_tokens, out.queued_time)
        for parent, state in touched.values():
            outputs = parent.take_outputs()
            if outputs is None:
                continue
            ro = state.make_request_output(
                outputs, parent.finished, parent.kv_transfer_params, parent.error
            )
            ro.request_id = parent.external_req_id
            ro.num_cached_tokens = parent.num_cached_tokens
            ro.prompt_logprobs = parent.prompt_logprobs
            self._deliver(state, ro, result)
        return result

    @staticmethod
    def _deliver(state: RequestState, ro: RequestOutput, result: OutputProcessorOutput) -> None:
        if state.queue is not None:
            state.queue.put(ro)
        else:
            result.request_outputs.append(ro)

    def _finish(self, state: RequestState) -> None:
        self.request_states.pop(state.request_id, None)
        siblings = self.external_req_ids.get(state.external_req_id)
        if siblings is not None:
            if state.request_id in siblings:
                siblings.remove(state.request_id)
            if not siblings:
                del self.external_req_ids[state.external_req_id]
        parent = state.parent
        if parent is not None and parent.finished:
            self.parent_requests.pop(parent.request_id, None)

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Forget the given requests. Each id is looked up as a parent id for n > 1 (expands
        to its unfinished children), then as an internal id, then as an external (user) id.
        Returns the internal ids to abort in the core; ids unknown here are passed through
        (the core ignores ids it does not hold). A request with a collector gets a final
        output with finish_reason "abort", so no waiter hangs."""
        to_abort: list[str] = []
        synthetic: list[EngineCoreOutput] = []
        for rid in request_ids:
            parent = self.parent_requests.get(rid)
            if parent is not None:
                ids = [c for c in parent.child_ids if c in parent.unfinished]
            elif rid in self.request_states:
                ids = [rid]
            else:
                ids = list(self.external_req_ids.get(rid, [rid]))
            for cid in ids:
                to_abort.append(cid)
                if cid in self.request_states:
                    synthetic.append(EngineCoreOutput(cid, [], finish_reason=FinishReason.ABORT))
        if synthetic:
            # Same path as a core-side abort; outputs for queue-less requests are dropped.
            saved, self.log_stats = self.log_stats, False
            try:
                self.process_outputs(synthetic)
            finally:
                self.log_stats = saved
        return to_abort

    def propagate_error(self, exc: BaseException) -> None:
        """The engine is gone: every waiting collector gets `exc`, every request is over."""
        seen: set[int] = set()
        for state in self.request_states.values():
            if state.queue is not None and id(state.queue) not in seen:
                seen.add(id(state.queue))
                state.queue.put(exc)
        self.request_states.clear()
        self.parent_requests.clear()
        self.external_req_ids.clear()
