"""Validation of the `kv_transfer_params` a request carries, before it reaches the engine.

A leg whose params lack a required field, carry one of the wrong type, or carry a value the
KV wire could not encode later is a client error (HTTP 400 naming the field, e.g.
``kv_transfer_params.transfer_id``), never an engine error: every field that ends up in a
notification is checked here against the very types (and so limits) of `kvconnector.wire`,
so nothing admitted can fail to encode on the writer thread and vanish.

`transfer_id` is optional in push mode, as in vLLM's push protocol: without it P and D match a
request by its id (exact, then without the engine suffix) and the prompt digest.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvconnector import wire

# field -> wire type, for a D leg (do_remote_prefill) of each mode.
_PUSH_D_REQUIRED = {
    "remote_engine_id": wire.EngineId,
    "remote_host": wire.Host,
    "remote_port": wire.Port,
    "tp_size": wire.TpSize,
}
_PUSH_D_OPTIONAL = {"transfer_id": wire.GivenTransferId}
_PULL_D_REQUIRED = {
    "remote_engine_id": wire.EngineId,
    "remote_host": wire.Host,
    "remote_port": wire.Port,
    "tp_size": wire.TpSize,
    "remote_block_ids": list[wire.BlockId],
    "num_prompt_tokens": int,
}
_P_LEG_OPTIONAL = {"transfer_id": wire.GivenTransferId}


def _check_field(name: str, value: Any, typ: Any) -> None:
    try:
        msgspec.convert(value, type=typ, strict=True)
    except msgspec.ValidationError as e:
        # msgspec names the place as `$` (or `$[i]` inside a list)
        detail = str(e).replace(" - at `$`", "").replace("`$[", f"`{name}[")
        raise ValueError(f"kv_transfer_params.{name}: {detail}") from None


def _check_fields(params: dict[str, Any], spec: dict[str, Any], required: bool) -> None:
    for name, typ in spec.items():
        if name not in params:
            if required:
                raise ValueError(f"kv_transfer_params.{name} is required")
            continue
        _check_field(name, params[name], typ)


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
        if mode == "push":
            _check_fields(params, _PUSH_D_REQUIRED, required=True)
            _check_fields(params, _PUSH_D_OPTIONAL, required=False)
        else:
            _check_fields(params, _PULL_D_REQUIRED, required=True)
    elif params.get("do_remote_decode"):
        _check_fields(params, _P_LEG_OPTIONAL, required=False)


def transfer_id_of(params: dict[str, Any] | None) -> str:
    """The request's transfer id, or "" when it has none (then ids and digest match it)."""
    tid = (params or {}).get("transfer_id")
    return tid if isinstance(tid, str) else ""
