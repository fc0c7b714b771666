"""Prompt logprobs, computed from the hidden states of the prefill's own forward pass.

A request with `SamplingParams.prompt_logprobs = k` gets, for every prompt position p >= 1,
the logprob of prompt token p given tokens 0..p-1, its rank, and the top-k alternatives
(vLLM's `prompt_logprobs`; lm-eval's loglikelihood reads them through `echo` + `logprobs`).
Position p's distribution is the model's output at row p - 1, so every chunk of a chunked
prefill contributes the rows it computed: the runner hands `rows()` the chunk and `take()`
the finished list when the prompt is done. The scheduler never serves such a request from
the prefix cache (engine/sched/kv_cache_manager.py): a cached block's rows would never be
computed, and the list would have holes.

Called by the model runner on the engine-core (or TP worker) thread; every TP rank runs the
same rows, so `compute_logits` (a collective under TP) is called alike on each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.protocol import Logprobs

_ROWS_PER_PASS = 256  # bounds the [rows, vocab] float32 logits of a long prompt


@dataclass
class PromptLogprobRows:
    """One request's rows of this step: hidden rows `first`..`first+count-1` predict prompt
    tokens `targets` (positions start+1 .. start+count)."""

    req_id: str
    top_k: int
    first: int
    targets: list[int]


@dataclass
class PromptLogprobs:
    """Prompt logprobs being gathered, per request id, across the steps of its prefill."""

    pending: dict[str, list[Logprobs]] = field(default_factory=dict)

    @staticmethod
    def rows(req_id: str, top_k: int | None, token_ids: list[int], num_prompt: int,
             start: int, count: int, first_row: int) -> PromptLogprobRows | None:
        """The rows of a chunk computing positions start..start+count-1 that predict a prompt
        token, or None (no prompt logprobs asked, or a chunk past the prompt)."""
        if top_k is None:
            return None
        end = min(start + count, num_prompt - 1)  # the last prompt row predicts no prompt token
        if end <= start:
            return None
        return PromptLogprobRows(req_id, top_k, first_row, token_ids[start + 1:end + 1])

    def compute(self, hidden: torch.Tensor, wanted: list[PromptLogprobRows],
                compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Append each request's entries for its rows of `hidden` (this step's output)."""
        for w in wanted:
            out = self.pending.setdefault(w.req_id, [])
            for lo in range(0, len(w.targets), _ROWS_PER_PASS):
                targets = w.targets[lo:lo + _ROWS_PER_PASS]
                index = torch.arange(w.first + lo, w.first + lo + len(targets),
                                     device=hidden.device)
                logits = compute_logits(hidden[index]).to(torch.float32)
                out.extend(_entries(torch.log_softmax(logits, dim=-1), targets, w.top_k))

    def take(self, req_id: str) -> list[Logprobs]:
        """The request's finished list (prompt positions 1..P-1), once."""
        return self.pending.pop(req_id, [])

    def drop(self, req_id: str) -> None:
        """A finished or preempted request: a preempted one recomputes its whole prompt."""
        self.pending.pop(req_id, None)


def _entries(logprobs: torch.Tensor, targets: list[int], top_k: int) -> list[Logprobs]:
    target = torch.tensor(targets, dtype=torch.long, device=logprobs.device).unsqueeze(1)
    target_lp = logprobs.gather(1, target)
    ranks = (logprobs > target_lp).sum(dim=-1).add_(1).tolist()
    lps = target_lp.squeeze(1).tolist()
    top_ids: list[list[int]] = [[] for _ in targets]
    top_vals: list[list[float]] = [[] for _ in targets]
    if top_k > 0:
        top = logprobs.topk(top_k, dim=-1)
        top_ids, top_vals = top.indices.tolist(), top.values.tolist()
    return [Logprobs(token_ids=[t, *top_ids[i]], logprobs=[lps[i], *top_vals[i]],
                     sampled_rank=ranks[i]) for i, t in enumerate(targets)]
