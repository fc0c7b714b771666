"""Per-step sampling inputs for a batch, as tensors (one row per request being sampled).

Built once per step by the model runner from the requests' `SamplingParams` and token
histories. Every optional tensor is `None` when no row of the batch needs it, so the sampler
can skip whole stages (the all-greedy, no-penalty batch is a single argmax).

Invariant: row `i` of every tensor, `generators[i]` and `num_logprobs[i]` describe the same
request; nothing about row `i` is derived from another row.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.protocol import SamplingParams

_GREEDY_EPS = 1e-5


@dataclass
class SamplingMetadata:
    """Tensors per row. Disabled options hold neutral values (top_k = vocab, top_p = 1...)."""

    num_rows: int
    all_greedy: bool
    all_random: bool
    # [N] float; 1.0 on greedy rows so a division never sees zero. None when all greedy.
    temperature: torch.Tensor | None
    # [N] bool, True where the row is greedy. None when all rows agree (see all_greedy).
    greedy_mask: torch.Tensor | None
    top_k: torch.Tensor | None  # [N] long, vocab size where disabled
    top_p: torch.Tensor | None  # [N] float, 1.0 where disabled
    min_p: torch.Tensor | None  # [N] float, 0.0 where disabled
    # Seeded rows: row index -> that request's own generator.
    generators: dict[int, torch.Generator]
    no_penalties: bool
    repetition_penalties: torch.Tensor | None  # [N] float
    presence_penalties: torch.Tensor | None  # [N] float
    frequency_penalties: torch.Tensor | None  # [N] float
    # Token histories as flat (row index, token id) pairs, only when a penalty is active.
    prompt_tokens: tuple[torch.Tensor, torch.Tensor] | None
    output_tokens: tuple[torch.Tensor, torch.Tensor] | None
    # Rows still under min_tokens: (row index tensor, token id tensor) pairs to mask, flat.
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None
    # Per row: how many top logprobs to return (0 = only the sampled one), None = no logprobs.
    num_logprobs: list[int | None]
    max_num_logprobs: int | None  # max over rows that want logprobs; None if none do
    device: torch.device = torch.device("cpu")
    # [N, ceil(V/32)] int32 packed allowed-token bits of constrained rows (-1: all allowed),
    # set by the runner from its grammar table (engine/structured); None when no row has one
    grammar_bitmask: torch.Tensor | None = None

    @property
    def needs_logprobs(self) -> bool:
        return self.max_num_logprobs is not None

    @property
    def plain_greedy(self) -> bool:
        """Every row takes its logits' argmax as they are: greedy, no penalty, no min_tokens
        mask, no logprobs, and no grammar mask (grammar_bitmask, which the runner sets, None)."""
        return (self.all_greedy and self.no_penalties and self.min_tokens_mask is None
                and not self.needs_logprobs and self.grammar_bitmask is None)

    def to(self, device: torch.device | str) -> SamplingMetadata:
        """A copy with every tensor on `device` (generators stay where they are)."""
        device = torch.device(device)

        def move(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return x.to(device)
            if isinstance(x, tuple):
                return tuple(t.to(device) for t in x)
            return x

        changes = {f.name: move(getattr(self, f.name)) for f in dataclasses.fields(self)
                   if f.name not in ("generators", "num_logprobs", "device")}
        return dataclasses.replace(self, device=device, **changes)


def uses_penalties(params: list[SamplingParams]) -> bool:
    """Whether any row has a repetition, presence or frequency penalty (only those read the
    token histories themselves)."""
    return any(p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
               or p.frequency_penalty != 0.0 for p in params)


def _flatten(rows: Sequence[Sequence[int]], device: torch.device | str
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged token lists -> (row index, token id) pairs, built without a per-token loop."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    row_ids = torch.repeat_interleave(torch.arange(len(rows)), lengths)
    token_ids = torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=torch.long)
    return row_ids.to(device), token_ids.to(device)


def build_sampling_metadata(
    params: list[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    generators: list[torch.Generator | None],
    eos_token_ids: list[int | None],
    device: torch.device | str = "cpu",
) -> SamplingMetadata:
    """Gather the batch's sampling options into tensors on `device`.

    `generators[i]` is request i's own generator (created by the runner from its seed) or
    None to use the default generator. `output_token_ids[i]` are the tokens generated so far
    (they drive penalties and min_tokens). Only penalties read the histories' tokens: without
    one (`uses_penalties`) any sequence of the right length will do, and the runner passes
    `range`s rather than copy every sequence's history each step.
    """
    n = len(params)
    if not (len(prompt_token_ids) == len(output_token_ids) == len(generators)
            == len(eos_token_ids) == n):
        raise ValueError("build_sampling_metadata: per-row lists must have equal lengths")

    greedy = [p.temperature < _GREEDY_EPS for p in params]
    all_greedy = all(greedy)
    all_random = not any(greedy)

    temperature = greedy_mask = top_k = top_p = min_p = None
    gens: dict[int, torch.Generator] = {}
    if not all_greedy:
        temperature = torch.tensor(
            [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
            dtype=torch.float32, device=device,
        )
        if not all_random:
            greedy_mask = torch.tensor(greedy, dtype=torch.bool, device=device)
        random_rows = [(i, p) for i, p in enumerate(params) if not greedy[i]]
        if any(p.top_k > 0 for _, p in random_rows):
            top_k = torch.tensor(
                [0 if g else max(p.top_k, 0) for p, g in zip(params, greedy, strict=True)],
                dtype=torch.long, device=device,
            )
        if any(p.top_p < 1.0 for _, p in random_rows):
            top_p = torch.tensor(
                [1.0 if g else p.top_p for p, g in zip(params, greedy, strict=True)],
                dtype=torch.float32, device=device,
            )
        if any(p.min_p > 0.0 for _, p in random_rows):
            min_p = torch.tensor(
                [0.0 if g else p.min_p for p, g in zip(params, greedy, strict=True)],
                dtype=torch.float32, device=device,
            )
        gens = {i: g for i, g in enumerate(generators) if g is not None and not greedy[i]}

    no_penalties = not uses_penalties(params)
    rep = pres = freq = prompt_t = output_t = None
    if not no_penalties:
        rep = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32,
                           device=device)
        pres = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32,
                            device=device)
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32,
                            device=device)
        prompt_t = _flatten(prompt_token_ids, device)
        output_t = _flatten(output_token_ids, device)

    mask_rows: list[int] = []
    mask_cols: list[int] = []
    for i, p in enumerate(params):
        if p.min_tokens and len(output_token_ids[i]) < p.min_tokens:
            stops = set(p.stop_token_ids)
            if eos_token_ids[i] is not None and not p.ignore_eos:
                stops.add(eos_token_ids[i])
            for t in sorted(stops):
                mask_rows.append(i)
                mask_cols.append(t)
    min_tokens_mask = None
    if mask_rows:
        min_tokens_mask = (
            torch.tensor(mask_rows, dtype=torch.long, device=device),
            torch.tensor(mask_cols, dtype=torch.long, device=device),
        )

    num_logprobs = [p.logprobs for p in params]
    wanted = [k for k in num_logprobs if k is not None]
    return SamplingMetadata(
        num_rows=n,
        all_greedy=all_greedy,
        all_random=all_random,
        temperature=temperature,
        greedy_mask=greedy_mask,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        generators=gens,
        no_penalties=no_penalties,
        repetition_penalties=rep,
        presence_penalties=pres,
        frequency_penalties=freq,
        prompt_tokens=prompt_t,
        output_tokens=output_t,
        min_tokens_mask=min_tokens_mask,
        num_logprobs=num_logprobs,
        max_num_logprobs=max(wanted) if wanted else None,
        device=torch.device(device),
    )
