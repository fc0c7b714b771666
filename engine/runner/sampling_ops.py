"""Batched logit transforms used by the sampler. Pure tensor functions, row-independent.

Invariant: the result for row i depends only on row i of every input (and, for sampling,
on the generator that row is given), so a request's tokens never depend on its batch.
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def apply_min_tokens_mask(
    logits: torch.Tensor, mask: tuple[torch.Tensor, torch.Tensor] | None
) -> torch.Tensor:
    """Forbid stop tokens on rows that have not reached min_tokens yet (in place)."""
    if mask is None:
        return logits
    rows, cols = mask
    keep = cols < logits.shape[-1]  # a stop id outside the vocabulary can never be sampled
    logits[rows[keep], cols[keep]] = _NEG_INF
    return logits


def apply_penalties(
    logits: torch.Tensor,
    prompt_tokens: tuple[torch.Tensor, torch.Tensor],
    output_tokens: tuple[torch.Tensor, torch.Tensor],
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens (HF rule: positive logits are divided,
    negative multiplied); presence and frequency penalties over output tokens only
    (OpenAI rule: logit -= frequency * count + presence * [count > 0]).

    Token histories are flat (row index, token id) pairs; ids outside the vocabulary are
    ignored. Returns a new tensor or `logits` modified in place.
    """
    n, v = logits.shape
    out_counts = torch.zeros((n, v), dtype=logits.dtype, device=logits.device)
    rows, toks = output_tokens
    keep = (toks >= 0) & (toks < v)
    out_counts.index_put_((rows[keep], toks[keep]), torch.ones_like(toks[keep], dtype=logits.dtype),
                          accumulate=True)
    seen = out_counts > 0
    rows, toks = prompt_tokens
    keep = (toks >= 0) & (toks < v)
    seen[rows[keep], toks[keep]] = True
    rep = repetition.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen & (rep != 1.0), penalized, logits)
    logits -= frequency.unsqueeze(1) * out_counts
    logits -= presence.unsqueeze(1) * (out_counts > 0).to(logits.dtype)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability."""
    probs = logits.softmax(dim=-1)
    top = probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill_(probs < min_p.unsqueeze(1) * top, _NEG_INF)


def _effective_k(top_k: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    disabled = (top_k <= 0) | (top_k >= vocab_size)
    return torch.where(disabled, vocab_size, top_k), disabled


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's top_k tokens (ties with the k-th kept, as HF does) and then the
    smallest set of most likely tokens whose probability reaches top_p (at least one)."""
    if top_k is None and top_p is None:
        return logits
    v = logits.shape[-1]
    if top_p is None:
        k, disabled = _effective_k(top_k, v)
        if bool(disabled.all()):
            return logits
        max_k = int(torch.where(disabled, 1, k).max())
        top_vals = logits.topk(max_k, dim=-1).values
        idx = torch.where(disabled, 1, k).sub(1).unsqueeze(1)
        thresh = top_vals.gather(1, idx)
        thresh.masked_fill_(disabled.unsqueeze(1), _NEG_INF)
        return logits.masked_fill_(logits < thresh, _NEG_INF)

    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        k, _ = _effective_k(top_k, v)
        thresh = sorted_logits.gather(1, (v - k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < thresh, _NEG_INF)
    probs = sorted_logits.softmax(dim=-1)
    cum = probs.cumsum(dim=-1)
    drop = cum <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, _NEG_INF)
    return logits.scatter_(1, order, sorted_logits)


def uniform_per_row(
    n: int, generators: dict[int, torch.Generator], device: torch.device
) -> torch.Tensor:
    """One U[0, 1) draw per row: seeded rows from their own generator (one draw per step),
    the others from the default generator."""
    if len(generators) < n:
        u = torch.rand(n, device=device)
    else:
        u = torch.empty(n, device=device)
    for i, gen in generators.items():
        u[i] = torch.rand((), generator=gen, device=gen.device)
    return u


def inverse_cdf_sample(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Column index per row, drawn with probability proportional to `weights` (>= 0, each
    row with a positive sum): the first column whose running sum exceeds u * total.
    A column of weight 0 is never chosen (its running sum equals its left neighbour's)."""
    cum = weights.cumsum(dim=-1)
    total = cum[:, -1:]
    target = u.to(cum.dtype).unsqueeze(1) * total
    # u * total may round up to total; stay strictly below so some column exceeds it.
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cum, target, right=True).squeeze(1)


# Width of the candidate set for rows truncated by top_p alone, and the widest candidate
# set worth a partial top-k (beyond it one full sort is cheaper).
_TOP_P_CANDIDATES = 1024
_MAX_CANDIDATES = 4096


def _sample_candidates(
    logits: torch.Tensor, k: torch.Tensor, k_on: torch.Tensor, p: torch.Tensor,
    p_on: torch.Tensor, u: torch.Tensor, width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k/top-p sampling over each row's `width` most likely tokens (no full sort).

    Returns (token ids, ok); ok is False on top_p-only rows whose nucleus is wider than the
    candidates (the caller resamples them over the whole vocabulary)."""
    vals, idx = logits.topk(width, dim=-1)  # descending
    pos = torch.arange(width, device=logits.device)
    vals = vals.masked_fill(pos.unsqueeze(0) >= k.unsqueeze(1), _NEG_INF)
    # HF order: top_p renormalizes over the top-k survivors, else over the whole vocabulary.
    lse = torch.where(k_on, vals.logsumexp(dim=-1), logits.logsumexp(dim=-1))
    probs = (vals - lse.unsqueeze(1)).exp_()
    cum = probs.cumsum(dim=-1)
    # Keep a token while the mass of the tokens ranked above it is still below top_p.
    keep = ((cum - probs) < p.unsqueeze(1)) | ~p_on.unsqueeze(1)
    keep[:, 0] = True
    ok = k_on | ~p_on | (cum[:, -1] >= p)
    chosen = inverse_cdf_sample(probs * keep, u)
    return idx.gather(1, chosen.unsqueeze(1)).squeeze(1), ok


def sample_random(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    generators: dict[int, torch.Generator],
) -> torch.Tensor:
    """One token per row from softmax(logits) restricted by top_k / top_p (HF semantics).

    Each row consumes exactly one uniform draw from its generator (seeded rows) or the
    default generator, so a seeded row's token depends on its row and generator alone.
    """
    n, v = logits.shape
    u = uniform_per_row(n, generators, logits.device)
    if top_k is None and top_p is None:
        return inverse_cdf_sample(logits.softmax(dim=-1), u)
    if top_k is None:
        k, k_off = torch.full_like(u, v, dtype=torch.long), torch.ones_like(u, dtype=torch.bool)
    else:
        k, k_off = _effective_k(top_k, v)
    p = top_p if top_p is not None else torch.ones_like(u)
    p_on = p < 1.0
    k_on = ~k_off
    truncated = k_on | p_on
    width = int(torch.where(k_on, k, torch.where(p_on, min(_TOP_P_CANDIDATES, v), 1)).max())
    if width > _MAX_CANDIDATES:
        full = apply_top_k_top_p(logits.clone(), top_k, top_p)
        return inverse_cdf_sample(full.softmax(dim=-1), u)

    out = torch.empty(n, dtype=torch.long, device=logits.device)
    plain = (~truncated).nonzero().squeeze(1)
    if plain.numel():
        out[plain] = inverse_cdf_sample(logits[plain].softmax(dim=-1), u[plain])
    rows = truncated.nonzero().squeeze(1)
    if not rows.numel():
        return out
    all_rows = rows.numel() == n
    sub = (lambda t: t) if all_rows else (lambda t: t[rows])
    ids, ok = _sample_candidates(sub(logits), sub(k), sub(k_on), sub(p), sub(p_on), sub(u), width)
    out[rows] = ids
    redo = rows[~ok]
    if redo.numel():
        full = apply_top_k_top_p(logits[redo], None, p[redo])
        out[redo] = inverse_cdf_sample(full.softmax(dim=-1), u[redo])
    return out
