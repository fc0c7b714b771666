"""Signed pull-mode transfer parameters (docs/security.md, "Pull mode: signed transfer
parameters").

Why: in pull mode D READs whatever blocks `kv_transfer_params` name, from whichever P they
name. Those params reach D through the client-facing HTTP API, so without a check a client
could name another user's blocks and decode from their KV (invariant 7).

What is signed: with a KV secret configured, P signs every field D acts on, HMAC-SHA256
(`KVSecurity.mac`) over a domain tag and, in this order, `remote_engine_id`, `remote_host`,
`remote_port`, `tp_size`, `remote_request_id`, `remote_block_ids`, `num_prompt_tokens`,
`prompt_digest` (of the prompt P prefilled) and `lease_expires_at` (P's wall clock, in whole
milliseconds: the end of P's lease on the blocks, `kv_lease_duration` after its prefill).
The hex tag travels as `signature` next to them, so a proxy that passes the params through
unchanged keeps working.

What D checks (`check`, a ValueError naming the field → HTTP 400 at admission): a signature
is present and verifies over the fields as received; the prompt digest is the digest of the
prompt D was given; the lease has not run out (`LEASE_MARGIN_S` before it, for clock skew and
the first heartbeat). Signature first, so a forged field is always reported as a bad
signature, whatever else is wrong with it.

Pure: no clock of its own (callers pass `now`), no I/O; any thread may call it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from kvconnector.security import KVSecurity, prompt_digest

DOMAIN = b"pdserve/pull-kv-transfer-params/v1"  # a tag for this use only, never a handshake's
LEASE_MARGIN_S = 0.5  # D refuses params this close to the end of P's lease
_SIG_HEX_LEN = 64  # SHA-256


def _expiry_ms(expires_at: float) -> int:
    # Signed as an integer: a proxy that re-encodes 12.0 as 12 changes nothing.
    return round(float(expires_at) * 1000)


def _utf8(s: str) -> bytes:
    return s.encode("utf-8", "surrogatepass")  # JSON may carry lone surrogates


def _parts(p: Mapping[str, Any]) -> list[bytes]:
    """The signed fields as bytes, in a fixed order; KeyError for a missing one."""
    return [
        DOMAIN,
        _utf8(p["remote_engine_id"]),
        _utf8(p["remote_host"]),
        str(int(p["remote_port"])).encode(),
        str(int(p["tp_size"])).encode(),
        _utf8(p["remote_request_id"]),
        ",".join(str(int(b)) for b in p["remote_block_ids"]).encode(),
        str(int(p["num_prompt_tokens"])).encode(),
        _utf8(p["prompt_digest"]),
        str(_expiry_ms(p["lease_expires_at"])).encode(),
    ]


def sign(security: KVSecurity, params: Mapping[str, Any]) -> str:
    """P: the hex signature over `params`' signed fields (all must be present)."""
    return security.mac(*_parts(params)).hex()


def signed(security: KVSecurity, params: dict[str, Any]) -> dict[str, Any]:
    """P: `params` with their `signature` when a secret is configured, else unchanged."""
    if not security.enabled:
        return params
    return {**params, "signature": sign(security, params)}


def _signature_bytes(params: Mapping[str, Any]) -> bytes:
    sig = params.get("signature")
    if sig is None:
        raise ValueError("kv_transfer_params.signature is required: this decode engine has a "
                         "KV secret and reads only blocks a prefill engine with the same "
                         "secret signed for this request")
    if not isinstance(sig, str) or len(sig) != _SIG_HEX_LEN:
        raise ValueError(f"kv_transfer_params.signature must be a {_SIG_HEX_LEN}-character hex "
                         "string")
    try:
        return bytes.fromhex(sig)
    except ValueError:
        raise ValueError("kv_transfer_params.signature must be a hex string") from None


def check(security: KVSecurity, params: Mapping[str, Any], prompt_token_ids: Sequence[int],
          now: float) -> None:
    """D: raise ValueError naming the field unless P signed exactly these params, for this
    prompt, and its lease is still good at wall time `now`. A no-op without a secret (the
    scheduler's own checks then apply, as in vLLM). `params` already passed
    `validate_request_params` (field types)."""
    if not security.enabled:
        return
    tag = _signature_bytes(params)
    for name, types in (("prompt_digest", (str,)), ("lease_expires_at", (int, float))):
        value = params.get(name)
        if value is None:
            raise ValueError(f"kv_transfer_params.{name} is required with a signature")
        if isinstance(value, bool) or not isinstance(value, types) or (
                isinstance(value, float) and not math.isfinite(value)):
            raise ValueError(f"kv_transfer_params.{name} must be "
                             f"{'a string' if types == (str,) else 'a finite number'}")
    if not security.verify(tag, *_parts(params)):
        raise ValueError("kv_transfer_params.signature does not match these parameters: they "
                         "were not issued by a prefill engine sharing this engine's KV secret, "
                         "or were changed on the way")
    if params["prompt_digest"] != prompt_digest(prompt_token_ids):
        raise ValueError("kv_transfer_params.prompt_digest does not match this request's "
                         "prompt: the parameters were issued for another prompt")
    if now > float(params["lease_expires_at"]) - LEASE_MARGIN_S:
        raise ValueError("kv_transfer_params.lease_expires_at has passed: P's lease on these "
                         "blocks is over (or about to be), so they may hold another request's "
                         "KV by now")
