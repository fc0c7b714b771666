"""Pull-mode kv_transfer_params: P's answer (what D needs to READ its blocks) and the check
of a D leg's params (ValueError naming the field → HTTP 400).

P's answer, forwarded verbatim by the proxy to D:
  do_remote_prefill, remote_engine_id, remote_host, remote_port, tp_size,
  remote_request_id (P's id: the id D heartbeats and names in its completion),
  remote_block_ids (P's prompt blocks in prompt order), num_prompt_tokens,
  prompt_digest (see meta.prompt_digest), lease_expires_at (P's wall clock, seconds since
  the epoch: D does not start reading params that arrive after it), transfer_id (when the P
  leg carried one), and with a KV secret configured `signature` (see signing.py: D then
  admits a D leg only with P's valid signature, for its own prompt, before the lease ends).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from kvconnector import wire
from kvconnector.endpoint import Endpoint
from kvconnector.params import KVParams, PullDecodeLeg, decode
from kvconnector.pull import signing
from kvconnector.security import KVSecurity

RequestParamsValidator = Callable[[dict[str, Any], Sequence[int]], None]


def carriable_request_id(request_id: Any) -> bool:
    """An id that fits both a heartbeat (no ',') and a completion notification."""
    if not isinstance(request_id, str) or "," in request_id:
        return False
    try:
        wire.encode_completion(request_id, 1)
    except ValueError:
        return False
    return True


def validate_request_params(params: Any) -> KVParams | None:
    """Pull mode's decode of a request's kv_transfer_params: the field types
    (`kvconnector.params.decode`), and a D leg's P request id and prompt length."""
    leg = decode(params, "pull")
    if isinstance(leg, PullDecodeLeg):
        if not carriable_request_id(leg.remote_request_id):
            raise ValueError("kv_transfer_params.remote_request_id must be a non-empty str "
                             "without ',' that does not start with a notification tag")
        if leg.num_prompt_tokens < 1:
            raise ValueError("kv_transfer_params.num_prompt_tokens must be at least 1")
    return leg


def request_params_validator(config: Any, wall_clock: Callable[[], float] = time.time
                             ) -> RequestParamsValidator:
    """The frontend's admission check for this engine (`engine.connector_registry` calls it once):
    field types, and with a KV secret P's signature over the params, for this prompt, within
    P's lease. ValueError naming the field → HTTP 400 before the request reaches the core."""
    security = KVSecurity.from_config(config.kv_transfer_config, warn=False)

    def validate(params: dict[str, Any], prompt_token_ids: Sequence[int]) -> None:
        leg = validate_request_params(params)
        if isinstance(leg, PullDecodeLeg):
            security.check_side_channel(leg.remote_host, leg.remote_port)  # before any dial
            if leg.tp_size != 1:  # pull engines run at TP 1 only (engine/config.py)
                raise ValueError(f"kv_transfer_params.tp_size: pull mode reads only from a "
                                 f"prefill engine of tensor_parallel_size 1, not {leg.tp_size} "
                                 f"(P/D of other or different TP sizes: use push mode)")
            signing.check(security, params, prompt_token_ids, wall_clock())

    return validate


def prefill_answer(endpoint: Endpoint, request_id: str, block_ids: list[int],
                   num_prompt_tokens: int, digest: str, lease_expires_at: float,
                   transfer_id: str) -> dict[str, Any]:
    """P's kv_transfer_params for a finished prefill whose blocks it now leases (wire form:
    the proxy forwards it to D as it is)."""
    answer = PullDecodeLeg(
        remote_engine_id=endpoint.engine_id, remote_host=endpoint.host,
        remote_port=endpoint.port, tp_size=1, remote_request_id=request_id,
        remote_block_ids=list(block_ids), num_prompt_tokens=num_prompt_tokens,
        prompt_digest=digest, lease_expires_at=round(lease_expires_at, 3),
    ).to_wire()
    if transfer_id:
        answer["transfer_id"] = transfer_id
    return answer
