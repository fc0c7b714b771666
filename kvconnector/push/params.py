"""The push connector's admission check of a request's kv_transfer_params (HTTP 400), run in
the API server (engine.connector_registry). Its own module, light on purpose: the API server
imports it without the connector's transport (NIXL, torch)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from engine.models.formats import load_arch
from kvconnector.params import PushDecodeLeg, decode
from kvconnector.security import KVSecurity

# Fields of a pull-mode D leg (P's answer) that mean nothing to a push D: a leg carrying one
# was meant for a pull deployment (or made up) and is refused at admission.
# Not remote_request_id: vLLM's push proxy names P's request id in the D leg (matching by
# request id when there is no transfer_id).
PULL_ONLY_FIELDS = ("remote_block_ids", "num_prompt_tokens", "lease_expires_at", "signature")


def request_params_validator(config: Any
                             ) -> Callable[[dict[str, Any], Sequence[int]], None]:
    """The frontend's admission check of a request's kv_transfer_params (HTTP 400)."""

    tp_size = config.tensor_parallel_size
    kv_heads = load_arch(config.model).num_kv_heads
    security = KVSecurity.from_config(config.kv_transfer_config, warn=False)

    def validate(params: dict[str, Any], prompt_token_ids: Sequence[int]) -> None:
        leg = decode(params, "push")
        if isinstance(leg, PushDecodeLeg):
            refuse_pull_fields(params)
            security.check_side_channel(leg.remote_host, leg.remote_port)  # before any dial
            if leg.tp_size != tp_size:
                check_tp_pair(leg.tp_size, tp_size, kv_heads)

    return validate


def refuse_pull_fields(params: dict[str, Any]) -> None:
    """A push D leg carrying a pull-mode field (P's answer naming its blocks) is a 400 naming
    it: a push D would register with P under an id no P request has and wait for nothing."""
    pull = next((name for name in PULL_ONLY_FIELDS if name in params), None)
    if pull is not None:
        raise ValueError(f"kv_transfer_params.{pull}: a pull-mode field; this decode engine "
                         f"runs push mode, where the prefill engine writes the KV: a D leg "
                         f"names the prefill engine and a transfer_id only")


def check_tp_pair(p_size: int, d_size: int, kv_heads: int) -> None:
    """Refuse (ValueError naming the field) a P/D pair of TP sizes push cannot pair: one must
    divide the other, and each rank must hold its own KV heads (docs/design.md §8)."""
    where = (f"kv_transfer_params.tp_size: the prefill engine has tensor_parallel_size "
             f"{p_size}, this decode engine {d_size}")
    if max(p_size, d_size) % min(p_size, d_size):
        raise ValueError(f"{where}; push between different sizes needs one to divide the other")
    if kv_heads % max(p_size, d_size):
        raise ValueError(f"{where}; the model's {kv_heads} KV heads do not split over "
                         f"{max(p_size, d_size)} ranks (KV heads replicated over ranks pair "
                         f"only between equal sizes)")
