"""The typed `kv_transfer_params` of a request: one msgspec struct per leg, decoded once.

The wire form is unchanged (a JSON object in the HTTP body, vLLM's field names); what a leg
is follows from its flag:
- `do_remote_decode` (a P leg, both modes): `PrefillLeg`;
- `do_remote_prefill` (a D leg): `PushDecodeLeg` in push mode, `PullDecodeLeg` in pull mode.
Params with neither flag are no transfer (None). Fields the struct does not name pass
through untouched (the proxy forwards P's pull answer verbatim, `signature` included).

`decode` is the one check: a leg whose params lack a required field, carry one of the wrong
type, or carry a value the KV wire could not encode later is a client error (HTTP 400 naming
the field, e.g. ``kv_transfer_params.transfer_id``), never an engine error. Every field that
ends up in a notification is typed with the very types (and so limits) of `kvconnector.wire`,
so nothing admitted can fail to encode on the writer thread and vanish. The frontend decodes
at admission (the 400); the engine core decodes the same dict once more when the request
enters its scheduler (`KVConnectorScheduler.decode_params`), and the scheduler halves read
only the struct from then on.

`transfer_id` is optional, as in vLLM's push protocol: without it P and D match a request by
its id (exact, then without the engine suffix) and the prompt digest.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import msgspec
from msgspec import UNSET, UnsetType

from kvconnector import wire

PREFILL_FLAG = "do_remote_decode"  # this leg prefills; D decodes
DECODE_FLAG = "do_remote_prefill"  # this leg decodes; P prefilled


class _Leg(msgspec.Struct, frozen=True):
    flag: ClassVar[str]

    def to_wire(self) -> dict[str, Any]:
        """The JSON object the HTTP body carries (unset optional fields left out)."""
        return {self.flag: True, **msgspec.to_builtins(self)}


class PrefillLeg(_Leg, frozen=True):
    """A P leg (`do_remote_decode`), either mode."""

    flag: ClassVar[str] = PREFILL_FLAG
    transfer_id: wire.GivenTransferId | UnsetType = UNSET

    @property
    def tid(self) -> str:
        """The transfer id, or "" when the leg has none."""
        return self.transfer_id or ""


class PushDecodeLeg(_Leg, frozen=True):
    """A push-mode D leg (`do_remote_prefill`): the P that writes into D's blocks."""

    flag: ClassVar[str] = DECODE_FLAG
    remote_engine_id: wire.EngineId
    remote_host: wire.Host
    remote_port: wire.Port
    tp_size: wire.TpSize
    transfer_id: wire.GivenTransferId | UnsetType = UNSET
    # False: do not ask P for its first token (a child of an n > 1 request); D recomputes it
    first_token: bool | UnsetType = UNSET

    @property
    def tid(self) -> str:
        return self.transfer_id or ""

    @property
    def wants_first_token(self) -> bool:
        return self.first_token is not False


class PullDecodeLeg(_Leg, frozen=True):
    """A pull-mode D leg: P's answer (`kvconnector.pull.params.prefill_answer`), which names
    the blocks D reads. `prompt_digest` and `lease_expires_at` are optional without a KV
    secret, as in vLLM; with one, `pull.signing` requires them (and `signature`, which it
    checks on the wire form, as received)."""

    flag: ClassVar[str] = DECODE_FLAG
    remote_engine_id: wire.EngineId
    remote_host: wire.Host
    remote_port: wire.Port
    tp_size: wire.TpSize
    remote_request_id: str
    remote_block_ids: list[wire.BlockId]
    num_prompt_tokens: int
    prompt_digest: str | None = None
    lease_expires_at: float | None = None  # P's wall clock, seconds since the epoch
    # the token P sampled, and its logprobs when the request asked (kvconnector/seed.py);
    # unsigned: whoever relays P's answer to D chooses the client's output anyway
    first_token_ids: list[wire.TokenId] | UnsetType = UNSET
    first_token_logprobs: wire.TokenLogprobs | UnsetType = UNSET
    first_token: bool | UnsetType = UNSET  # False: ignore first_token_ids (n > 1)

    @property
    def wants_first_token(self) -> bool:
        return self.first_token is not False


KVParams = PrefillLeg | PushDecodeLeg | PullDecodeLeg
DECODE_LEGS: dict[str, type[PushDecodeLeg] | type[PullDecodeLeg]] = {
    "push": PushDecodeLeg, "pull": PullDecodeLeg}

_MISSING = re.compile(r"Object missing required field `(\w+)`")
_AT_FIELD = re.compile(r"(.*) - at `\$\.(\w+)(.*)`$")


def _field_error(message: str) -> str:
    """msgspec's message, with the place named as the kv_transfer_params field."""
    if m := _MISSING.fullmatch(message):
        return f"kv_transfer_params.{m[1]} is required"
    if m := _AT_FIELD.fullmatch(message):
        detail, name, inner = m[1], m[2], m[3]
        return f"kv_transfer_params.{name}: {detail}" + (
            f" - at `{name}{inner}`" if inner else "")
    return f"kv_transfer_params: {message}"


def decode(params: Any, mode: str) -> KVParams | None:
    """The typed leg of `params` (None: no transfer); ValueError naming the offending field.
    `mode` is "push" or "pull"."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ValueError("kv_transfer_params must be an object")
    for flag in (DECODE_FLAG, PREFILL_FLAG):
        if flag in params and not isinstance(params[flag], bool):
            raise ValueError(f"kv_transfer_params.{flag} must be a boolean")
    if params.get(DECODE_FLAG) and params.get(PREFILL_FLAG):
        raise ValueError("kv_transfer_params: do_remote_prefill and do_remote_decode exclude "
                         "each other")
    if params.get(DECODE_FLAG):
        leg: type[KVParams] = DECODE_LEGS[mode]
    elif params.get(PREFILL_FLAG):
        leg = PrefillLeg
    else:
        return None
    try:
        return msgspec.convert(params, type=leg, strict=True)
    except msgspec.ValidationError as e:
        raise ValueError(_field_error(str(e))) from None
