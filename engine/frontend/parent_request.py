"""ParentRequest: an n > 1 request fanned out into n independent child core requests.

The core only ever sees n = 1 requests. Child i has internal id f"{i}_{parent internal id}",
n = 1, and seed + i when the parent has a seed (so the samples differ but are reproducible).
The parent folds the children's outputs back into one RequestOutput per update, with the
samples sorted by index:
  FINAL_ONLY  one output, once every child has finished, holding all n samples;
  CUMULATIVE  every update holds the latest full state of every child heard from so far;
  DELTA       every update holds the deltas of the children that moved in that pass.
`finished` is true once every child has finished.
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine.connector_api import ConnectorSpec
from engine.frontend.input_processor import external_request_id
from engine.frontend.outputs import CompletionOutput
from engine.protocol import EngineCoreRequest, Logprobs, RequestOutputKind


def child_request_id(index: int, parent_request_id: str) -> str:
    return f"{index}_{parent_request_id}"


class ParentRequest:
    def __init__(self, request: EngineCoreRequest, external_req_id: str | None = None,
                 kv_spec: ConnectorSpec | None = None) -> None:
        self.request = request
        self.kv_spec = kv_spec  # the connector's rule for each child's kv_transfer_params
        self.request_id = request.request_id  # internal id of the user request
        self.external_req_id = external_req_id or external_request_id(request.request_id)
        self.params = request.sampling_params
        self.n = self.params.n
        self.output_kind = self.params.output_kind
        self.child_ids = [child_request_id(i, self.request_id) for i in range(self.n)]
        self.unfinished: set[str] = set(self.child_ids)
        self.latest: dict[int, CompletionOutput] = {}  # CUMULATIVE / FINAL_ONLY
        self.pending: dict[int, CompletionOutput] = {}  # DELTA, this pass only
        self.kv_transfer_params: dict[str, Any] | None = None
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[Logprobs | None] | None = None
        self.error: str | None = None
        self.final_sent = False

    def fan_out(self) -> list[EngineCoreRequest]:
        """The n child requests to add to the OutputProcessor and the core, index order."""
        return [self._child(i) for i in range(self.n)]

    def _child(self, index: int) -> EngineCoreRequest:
        p = self.params
        seed = None if p.seed is None else p.seed + index
        params = msgspec.structs.replace(p, n=1, seed=seed)
        kv = self.request.kv_transfer_params
        if kv is not None and self.kv_spec is not None:
            kv = self.kv_spec.sample_params(kv, index)
        return msgspec.structs.replace(
            self.request, request_id=self.child_ids[index], sampling_params=params,
            kv_transfer_params=kv,
        )

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def record(
        self,
        child_id: str,
        output: CompletionOutput | None,
        finished: bool,
        kv_transfer_params: dict[str, Any] | None,
        num_cached_tokens: int,
        error: str | None,
    ) -> None:
        """A child's update from this pass (output None: FINAL_ONLY child not done yet)."""
        if finished:
            self.unfinished.discard(child_id)
        if kv_transfer_params is not None:
            self.kv_transfer_params = kv_transfer_params
        if num_cached_tokens:
            self.num_cached_tokens = max(self.num_cached_tokens, num_cached_tokens)
        if error is not None and self.error is None:
            self.error = error
        if output is None:
            return
        if self.output_kind == RequestOutputKind.DELTA:
            old = self.pending.get(output.index)
            if old is None:
                self.pending[output.index] = output
            else:
                old.merge_delta(output)
        else:
            self.latest[output.index] = output

    def take_outputs(self) -> list[CompletionOutput] | None:
        """The parent's samples for this pass, or None when there is nothing to send."""
        if self.output_kind == RequestOutputKind.FINAL_ONLY:
            if not self.finished or self.final_sent:
                return None
            self.final_sent = True
            return [self.latest[i] for i in sorted(self.latest)]
        if self.output_kind == RequestOutputKind.DELTA:
            outs = [self.pending[i] for i in sorted(self.pending)]
            self.pending = {}
            return outs or None
        return [self.latest[i] for i in sorted(self.latest)] or None
