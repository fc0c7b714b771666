"""Validation of the `kv_transfer_params` a request carries, before it reaches the engine.

A D leg whose params lack a required field or carry one of the wrong type is a client
error (HTTP 400 naming the field), never an engine crash.
"""

from __future__ import annotations

from typing import Any

# field -> accepted types, for a D leg (do_remote_prefill) of each mode.
_PUSH_D = {
    "remote_engine_id": (str,),
    "remote_host": (str,),
    "remote_port": (int,),
    "tp_size": (int,),
    "transfer_id": (str,),
}
_PULL_D = {
    "remote_engine_id": (str,),
    "remote_host": (str,),
    "remote_port": (int,),
    "tp_size": (int,),
    "remote_block_ids": (list,),
    "num_prompt_tokens": (int,),
}
_P_LEG_OPTIONAL = {"transfer_id": (str,)}


def _check_fields(params: dict[str, Any], spec: dict[str, tuple[type, ...]],
                  required: bool) -> None:
    for name, types in spec.items():
        if name not in params:
            if required:
                raise ValueError(f"kv_transfer_params.{name} is required")
            continue
        value = params[name]
        if isinstance(value, bool) or not isinstance(value, types):
            expected = " or ".join(t.__name__ for t in types)
            raise ValueError(
                f"kv_transfer_params.{name} must be {expected}, got {type(value).__name__}"
            )
    port = params.get("remote_port")
    if isinstance(port, int) and not 0 < port < 65536:
        raise ValueError(f"kv_transfer_params.remote_port out of range: {port}")
    tp = params.get("tp_size")
    if isinstance(tp, int) and tp < 1:
        raise ValueError(f"kv_transfer_params.tp_size must be at least 1, got {tp}")


def validate_kv_transfer_params(params: Any, mode: str) -> None:
    """Raise ValueError naming the offending field; `mode` is "push" or "pull"."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise ValueError("kv_transfer_params must be an object")
    for flag in ("do_remote_prefill", "do_remote_decode"):
        if flag in params and not isinstance(params[flag], bool):
            raise ValueError(f"kv_transfer_params.{flag} must be a boolean")
    if params.get("do_remote_prefill") and params.get("do_remote_decode"):
        raise ValueError("kv_transfer_params: do_remote_prefill and do_remote_decode exclude "
                         "each other")
    if params.get("do_remote_prefill"):
        _check_fields(params, _PUSH_D if mode == "push" else _PULL_D, required=True)
        if mode == "pull":
            ids = params["remote_block_ids"]
            if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in ids):
                raise ValueError("kv_transfer_params.remote_block_ids must be non-negative ints")
    elif params.get("do_remote_decode"):
        _check_fields(params, _P_LEG_OPTIONAL, required=False)
