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
from kvconnector.params import validate_kv_transfer_params
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


def validate_request_params(params: Any) -> None:
    """The frontend's check of a request's kv_transfer_params in pull mode."""
    validate_kv_transfer_params(params, "pull")
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return
    rrid = params.get("remote_request_id")
    if rrid is None:
        raise ValueError("kv_transfer_params.remote_request_id is required")
    if not carriable_request_id(rrid):
        raise ValueError("kv_transfer_params.remote_request_id must be a non-empty str "
                         "without ',' that does not start with a notification tag")
    digest = params.get("prompt_digest")
    if digest is not None and not isinstance(digest, str):
        raise ValueError("kv_transfer_params.prompt_digest must be str, "
                         f"got {type(digest).__name__}")
    expires = params.get("lease_expires_at")
    if expires is not None and (isinstance(expires, bool)
                                or not isinstance(expires, (int, float))):
        raise ValueError("kv_transfer_params.lease_expires_at must be a number, "
                         f"got {type(expires).__name__}")
    if params["num_prompt_tokens"] < 1:
        raise ValueError("kv_transfer_params.num_prompt_tokens must be at least 1")
    if not params["remote_host"]:
        raise ValueError("kv_transfer_params.remote_host must not be empty")


def request_params_validator(config: Any, wall_clock: Callable[[], float] = time.time
                             ) -> RequestParamsValidator:
    """The frontend's admission check for this engine (`engine.kv_connector` calls it once):
    field types, and with a KV secret P's signature over the params, for this prompt, within
    P's lease. ValueError naming the field → HTTP 400 before the request reaches the core."""
    security = KVSecurity.from_config(config.kv_transfer_config, warn=False)

    def validate(params: dict[str, Any], prompt_token_ids: Sequence[int]) -> None:
        validate_request_params(params)
        if isinstance(params, dict) and params.get("do_remote_prefill"):
            signing.check(security, params, prompt_token_ids, wall_clock())

    return validate


def prefill_answer(endpoint: Endpoint, request_id: str, block_ids: list[int],
                   num_prompt_tokens: int, digest: str, lease_expires_at: float,
                   transfer_id: Any) -> dict[str, Any]:
    """P's kv_transfer_params for a finished prefill whose blocks it now leases."""
    answer: dict[str, Any] = {
        "do_remote_prefill": True,
        "remote_engine_id": endpoint.engine_id,
        "remote_host": endpoint.host,
        "remote_port": endpoint.port,
        "tp_size": 1,
        "remote_request_id": request_id,
        "remote_block_ids": list(block_ids),
        "num_prompt_tokens": num_prompt_tokens,
        "prompt_digest": digest,
        "lease_expires_at": round(lease_expires_at, 3),
    }
    if isinstance(transfer_id, str):
        answer["transfer_id"] = transfer_id
    return answer
