"""P's first token on its way to D (docs/design.md §3): what P sampled, in the forms it takes.

P samples the request's first token while it prefills; D continues from it instead of running
a forward over the last prompt position again. Push mode carries it in the completion of the
WRITE (`wire.FirstToken` in a PUSH_DONE); pull mode in P's kv_transfer_params
(`first_token_ids`, `first_token_logprobs`, vLLM's proposed field name for the first).
On D the scheduler half hands it to the engine as a `SeededToken` (`take_seeded_token`).

`check` is the one gate on D: a token D cannot continue from exactly (an id outside the
vocabulary, a request that asks for logprobs the seed lacks or of another count) is refused,
and the request computes its last prompt position as before.
"""

from __future__ import annotations

import math
from typing import Any

from engine.connector_seam import SeededToken
from engine.protocol import Logprobs
from kvconnector import wire

FIRST_TOKEN_IDS = "first_token_ids"  # pull: in P's kv_transfer_params
FIRST_TOKEN_LOGPROBS = "first_token_logprobs"


def sampled(output_token_ids: list[int], logprobs: Logprobs | None) -> SeededToken | None:
    """P: what a finished prefill leg sampled (None when it sampled nothing)."""
    if not output_token_ids:
        return None
    return SeededToken(list(output_token_ids[:1]), logprobs)


def to_wire(seed: SeededToken | None) -> wire.FirstToken | None:
    """Push: the notification form; None when it does not fit the wire's limits."""
    if seed is None or len(seed.token_ids) > wire.MAX_FIRST_TOKENS:
        return None
    lp = seed.logprobs
    wire_lp = None
    if lp is not None:
        if not 1 <= len(lp.token_ids) <= wire.MAX_LOGPROBS:
            return None
        wire_lp = wire.TokenLogprobs(list(lp.token_ids), list(lp.logprobs), lp.sampled_rank)
    return wire.FirstToken(list(seed.token_ids), wire_lp)


def from_wire(token: wire.FirstToken | None) -> SeededToken | None:
    if token is None:
        return None
    lp = token.logprobs
    logprobs = None if lp is None else Logprobs(list(lp.token_ids), list(lp.logprobs),
                                                lp.sampled_rank)
    return SeededToken(list(token.token_ids), logprobs)


def to_params(seed: SeededToken | None) -> dict[str, Any]:
    """Pull: the fields P adds to its kv_transfer_params (JSON: logprobs only when finite)."""
    if seed is None:
        return {}
    out: dict[str, Any] = {FIRST_TOKEN_IDS: list(seed.token_ids)}
    lp = seed.logprobs
    if lp is not None:
        if not all(math.isfinite(x) for x in lp.logprobs):
            return {}  # JSON cannot carry -inf: D recomputes the position
        # wire.TokenLogprobs, array-like: [token_ids, logprobs, sampled_rank]
        out[FIRST_TOKEN_LOGPROBS] = [list(lp.token_ids), list(lp.logprobs), lp.sampled_rank]
    return out


def from_params(ids: list[int] | None, logprobs: wire.TokenLogprobs | None
                ) -> SeededToken | None:
    if not ids:
        return None
    return from_wire(wire.FirstToken(list(ids), logprobs))


def check(seed: SeededToken | None, vocab_size: int, num_logprobs: int | None) -> str | None:
    """Why D cannot continue exactly from `seed` (None: it can). `num_logprobs`: what the
    request asks for (None: no logprobs)."""
    if seed is None:
        return "no first token came with the KV"
    if len(seed.token_ids) != 1:
        return f"{len(seed.token_ids)} first tokens (one expected)"
    if vocab_size and not all(0 <= t < vocab_size for t in seed.token_ids):
        return f"first token {seed.token_ids} outside the vocabulary of {vocab_size}"
    lp = seed.logprobs
    if num_logprobs is None:
        return None
    if lp is None:
        return "the request asks for logprobs and the first token came without them"
    if len(lp.token_ids) != len(lp.logprobs) or lp.token_ids[0] != seed.token_ids[0]:
        return "the first token's logprobs do not describe it"
    return None
