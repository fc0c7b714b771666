"""Token sampler: float32 logits [N, V] + SamplingMetadata -> one token per row (+ logprobs).

Pipeline (each stage skipped when no row needs it):
  raw logprobs (log_softmax of the raw logits, for rows that asked)
  -> grammar mask (tokens a constrained row's grammar forbids get -inf)
  -> min_tokens mask (stop tokens and EOS forbidden until min_tokens outputs exist)
  -> penalties (repetition over prompt+output, presence/frequency over output)
  -> greedy rows: argmax                                         (temperature < 1e-5)
  -> random rows: / temperature -> min_p -> top_k -> top_p -> inverse-CDF sample
     (top_k / top_p work on each row's most likely candidates, not a full-vocabulary sort)

Called by the model runner on the engine-core (or worker) thread once per step. Does not
modify the caller's logits tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels.argmax import argmax_rows
from engine.protocol import Logprobs
from engine.runner.sampling_metadata import SamplingMetadata, build_sampling_metadata
from engine.runner.sampling_ops import (
    apply_min_p,
    apply_min_tokens_mask,
    apply_penalties,
    sample_random,
)
from engine.structured.grammars import apply_bitmask

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata", "build_sampling_metadata"]


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] long
    logprobs: list[Logprobs | None]  # per row; None where the request asked for none


class Sampler:
    """Stateless; one instance per model runner."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != meta.num_rows:
            raise ValueError(
                f"sampler: logits shape {tuple(logits.shape)} does not match "
                f"{meta.num_rows} rows of sampling metadata"
            )
        if meta.device != logits.device:
            meta = meta.to(logits.device)  # metadata built for another device: follow logits
        if meta.plain_greedy:
            # Hot path: plain greedy decoding is one argmax, exactly what HF greedy does.
            return SamplerOutput(argmax_rows(logits), [None] * meta.num_rows)

        raw_logprobs = None
        if meta.needs_logprobs:
            raw_logprobs = self._raw_logprobs(logits, meta)

        logits = logits.to(torch.float32, copy=True)
        if meta.grammar_bitmask is not None:
            logits = apply_bitmask(logits, meta.grammar_bitmask)
        logits = apply_min_tokens_mask(logits, meta.min_tokens_mask)
        if not meta.no_penalties:
            logits = apply_penalties(
                logits, meta.prompt_tokens, meta.output_tokens,
                meta.repetition_penalties, meta.presence_penalties, meta.frequency_penalties,
            )
        sampled = self._sample(logits, meta)
        logprobs: list[Logprobs | None] = [None] * meta.num_rows
        if raw_logprobs is not None:
            logprobs = self._gather_logprobs(raw_logprobs, sampled, meta)
        return SamplerOutput(sampled, logprobs)

    @staticmethod
    def _sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        greedy = None if meta.all_random else argmax_rows(logits)
        if meta.all_greedy:
            return greedy
        assert meta.temperature is not None
        logits.div_(meta.temperature.unsqueeze(1))
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        sampled = sample_random(logits, meta.top_k, meta.top_p, meta.generators)
        if greedy is None:
            return sampled
        return torch.where(meta.greedy_mask, greedy, sampled)

    @staticmethod
    def _raw_logprobs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """log_softmax of the unprocessed logits (before penalties and temperature)."""
        rows = [i for i, k in enumerate(meta.num_logprobs) if k is not None]
        if len(rows) == meta.num_rows:
            return torch.log_softmax(logits.to(torch.float32), dim=-1)
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        full = torch.zeros_like(logits, dtype=torch.float32)
        full[index] = torch.log_softmax(logits[index].to(torch.float32), dim=-1)
        return full

    @staticmethod
    def _gather_logprobs(
        raw: torch.Tensor, sampled: torch.Tensor, meta: SamplingMetadata
    ) -> list[Logprobs | None]:
        sampled_lp = raw.gather(1, sampled.unsqueeze(1))
        # Rank 1 = most likely token; ties with the sampled token do not push it down.
        ranks = (raw > sampled_lp).sum(dim=-1).add_(1)
        max_n = meta.max_num_logprobs or 0
        top_vals = top_ids = None
        if max_n > 0:
            top = raw.topk(max_n, dim=-1)
            top_vals, top_ids = top.values.tolist(), top.indices.tolist()
        sampled_l, sampled_lp_l, ranks_l = (
            sampled.tolist(), sampled_lp.squeeze(1).tolist(), ranks.tolist()
        )
        out: list[Logprobs | None] = []
        for i, k in enumerate(meta.num_logprobs):
            if k is None:
                out.append(None)
                continue
            ids = [sampled_l[i]]
            lps = [sampled_lp_l[i]]
            if k > 0:
                ids += top_ids[i][:k]
                lps += top_vals[i][:k]
            out.append(Logprobs(token_ids=ids, logprobs=lps, sampled_rank=ranks_l[i]))
        return out
