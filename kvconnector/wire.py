"""Notification formats exchanged between engines through NIXL (docs/design.md §3), and
request-id normalisation.

Every message is ``bytes``:

=================  ==========  ================================================================
message            direction   format
=================  ==========  ================================================================
registration       D -> P      ``PUSH_REG:`` + msgpack map (exactly the :class:`PushReg` fields)
completion         P -> D      ``<D request_id>:<P tp_size>`` (rides on each WRITE)
completion with    P -> D      ``PUSH_DONE:`` + msgpack :class:`DoneBody` (rides on each WRITE
first token                    into a registration that asked for it: ``first_token``)
heartbeat          D -> P      ``HB:`` + comma-separated transfer ids still waiting (the base
                               request id of a transfer that has no transfer_id)
failure            P -> D      ``PUSH_FAIL:`` + msgpack ``{request_id, transfer_id, reason}``
cancel             D -> P      ``PUSH_CANCEL:`` + msgpack ``{request_id, transfer_id}``
cancel ack         P -> D      ``PUSH_CANCEL_ACK:`` + msgpack ``{request_id, transfer_id}``
=================  ==========  ================================================================

Dispatch is on the text before the FIRST ``:``: one of the reserved tags selects a typed body;
anything else is a completion, parsed by splitting on the LAST ``:`` (request ids may contain
``:``). So a completion's request id must not begin with a reserved tag followed by ``:`` (or be
a bare tag); :func:`encode_completion` refuses such ids.

A registration carries ``prompt_digest`` (:func:`kvconnector.security.prompt_digest` of D's
prompt tokens); P writes only into a registration whose digest equals that of the prompt it
prefilled. The field may be absent on the wire (``""``): such a registration matches no prompt
and P answers it with PUSH_FAIL, so a D that does not send digests recomputes instead of waiting.

Invariant: :func:`decode_notif` is strict and total. It returns one of the typed structs or
raises :class:`MalformedNotif`, never anything else, whatever the input (wrong types, missing or
extra fields, trailing bytes, non-UTF-8, negative ids, oversized lists). The caller counts and
drops a malformed message; it never reaches the connector loop as an exception.
"""

from __future__ import annotations

import re
from typing import Annotated

import msgspec

__all__ = [
    "MAX_NOTIF_BYTES",
    "TAGS",
    "Completion",
    "FirstToken",
    "Heartbeat",
    "MalformedNotif",
    "Notif",
    "PushCancel",
    "PushCancelAck",
    "PushFail",
    "PushReg",
    "base_request_id",
    "decode_notif",
    "encode_completion",
    "encode_completion_with_token",
    "encode_heartbeat",
    "encode_push_cancel",
    "encode_push_cancel_ack",
    "encode_push_fail",
    "encode_push_reg",
    "heartbeat_can_carry",
    "notif_kind",
    "reads_as_tagged",
]

PUSH_REG = "PUSH_REG"
PUSH_FAIL = "PUSH_FAIL"
PUSH_CANCEL = "PUSH_CANCEL"
PUSH_CANCEL_ACK = "PUSH_CANCEL_ACK"
PUSH_DONE = "PUSH_DONE"
HB = "HB"
COMPLETION = "COMPLETION"  # pseudo-kind: completions carry no tag
TAGS: tuple[str, ...] = (PUSH_REG, PUSH_FAIL, PUSH_CANCEL, PUSH_CANCEL_ACK, PUSH_DONE, HB)
MAX_FIRST_TOKENS = 16
MAX_LOGPROBS = 64

MAX_NOTIF_BYTES = 4 * 1024 * 1024  # a 1M-token prompt at block size 16 fits several times
MAX_ID_LEN = 1024
MAX_KV_GROUPS = 64
MAX_BLOCKS_PER_GROUP = 1 << 20
MAX_HEARTBEAT_IDS = 1 << 16
MAX_REASON_LEN = 4096
MAX_TP_SIZE = 4096

# Field types. msgspec rejects bool for int and float for int, so these are exact.
ReqId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LEN)]
TransferId = Annotated[str, msgspec.Meta(max_length=MAX_ID_LEN)]  # "" = none: match by req id
# A transfer id a request may give: what a heartbeat can carry (non-empty, no ',').
GivenTransferId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LEN,
                                              pattern=r"^[^,]*$")]
MAX_DIGEST_LEN = 64
Digest = Annotated[str, msgspec.Meta(max_length=MAX_DIGEST_LEN)]
EngineId = Annotated[str, msgspec.Meta(max_length=MAX_ID_LEN)]
Host = Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
TpSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_TP_SIZE)]
BlockId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
BlockIndex = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
GroupBlockIds = Annotated[list[BlockId], msgspec.Meta(max_length=MAX_BLOCKS_PER_GROUP)]
Reason = Annotated[str, msgspec.Meta(max_length=MAX_REASON_LEN)]


class MalformedNotif(ValueError):
    """A notification that does not parse. ``reason`` says why; ``head`` is a short repr."""

    def __init__(self, reason: str, raw: object = b"") -> None:
        head = bytes(raw[:48]) if isinstance(raw, (bytes, bytearray, memoryview)) else raw
        super().__init__(f"malformed notification ({reason}): {head!r}")
        self.reason = reason
        self.head = head


class _Strict(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    pass


class PushReg(_Strict):
    """D's registration of pre-allocated blocks for one request (D -> P)."""

    request_id: ReqId  # D's own id; echoed in the completion
    transfer_id: TransferId
    decode_engine_id: EngineId
    decode_host: Host
    decode_port: Port
    decode_tp_size: TpSize
    local_block_ids: Annotated[list[GroupBlockIds], msgspec.Meta(min_length=1,
                                                                 max_length=MAX_KV_GROUPS)]
    first_block_index: BlockIndex  # index in the prompt of the first block listed
    remote_engine_id: EngineId
    remote_host: Host
    remote_port: Port
    remote_tp_size: TpSize
    prompt_digest: Digest = ""  # of D's whole prompt; "" matches nothing
    # which of D's TP ranks registers (its blocks hold that rank's heads; docs/design.md §8)
    decode_tp_rank: Annotated[int, msgspec.Meta(ge=0, lt=MAX_TP_SIZE)] = 0
    # D asks P for the token P sampled: its completion then carries it (PUSH_DONE)
    first_token: bool = False


TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]


class TokenLogprobs(_Strict, array_like=True):
    """`engine.protocol.Logprobs` of the first position: the sampled token first, then the
    top-N (floats as P computed them, -inf included)."""

    token_ids: Annotated[list[TokenId], msgspec.Meta(min_length=1, max_length=MAX_LOGPROBS)]
    logprobs: Annotated[list[float], msgspec.Meta(min_length=1, max_length=MAX_LOGPROBS)]
    sampled_rank: Annotated[int, msgspec.Meta(ge=0)]


class FirstToken(_Strict):
    """The token(s) P sampled for the request (and their logprobs when it asked for them)."""

    token_ids: Annotated[list[TokenId], msgspec.Meta(min_length=1,
                                                     max_length=MAX_FIRST_TOKENS)]
    logprobs: TokenLogprobs | None = None


class DoneBody(_Strict):
    """The body of a completion that carries P's first token."""

    request_id: ReqId
    tp_size: TpSize
    first_token: FirstToken


class Completion(_Strict):
    """P's WRITE for ``request_id`` (D's id) has landed; with P's first token when D asked."""

    request_id: str
    tp_size: int
    first_token: FirstToken | None = None


class Heartbeat(_Strict):
    """D still waits for these transfers (extends P's leases): transfer ids, and the base
    request ids of transfers without one."""

    transfer_ids: tuple[str, ...]


class PushFail(_Strict):
    """P will not write this request."""

    request_id: ReqId
    transfer_id: TransferId
    reason: Reason


class PushCancel(_Strict):
    """D gave up on this request; P must stop and answer with PUSH_CANCEL_ACK."""

    request_id: ReqId
    transfer_id: TransferId


class PushCancelAck(_Strict):
    """No WRITE for this request can still land on D."""

    request_id: ReqId
    transfer_id: TransferId


Notif = PushReg | Completion | Heartbeat | PushFail | PushCancel | PushCancelAck

_ENC = msgspec.msgpack.Encoder()
_BODY_DECODERS: dict[bytes, msgspec.msgpack.Decoder] = {
    PUSH_REG.encode(): msgspec.msgpack.Decoder(PushReg),
    PUSH_FAIL.encode(): msgspec.msgpack.Decoder(PushFail),
    PUSH_CANCEL.encode(): msgspec.msgpack.Decoder(PushCancel),
    PUSH_CANCEL_ACK.encode(): msgspec.msgpack.Decoder(PushCancelAck),
    PUSH_DONE.encode(): msgspec.msgpack.Decoder(DoneBody),
}
_TAG_BYTES = frozenset(t.encode() for t in TAGS)
_TP_RE = re.compile(r"[1-9][0-9]{0,3}")
_SUFFIX_RE = re.compile(r"^(.+)-[0-9a-f]{8}$", re.DOTALL)


# ---------------------------------------------------------------- encoders


def _validated(struct: _Strict) -> bytes:
    """Encode and run the strict decoder on the result, so no encoder emits what decode rejects."""
    body = _ENC.encode(struct)
    try:
        msgspec.msgpack.decode(body, type=type(struct))
    except msgspec.ValidationError as e:
        raise ValueError(f"invalid {type(struct).__name__}: {e}") from None
    return body


def encode_push_reg(reg: PushReg) -> bytes:
    return b"PUSH_REG:" + _validated(reg)


def encode_push_fail(request_id: str, transfer_id: str, reason: str) -> bytes:
    return b"PUSH_FAIL:" + _validated(PushFail(request_id, transfer_id, reason[:MAX_REASON_LEN]))


def encode_push_cancel(request_id: str, transfer_id: str) -> bytes:
    return b"PUSH_CANCEL:" + _validated(PushCancel(request_id, transfer_id))


def encode_push_cancel_ack(request_id: str, transfer_id: str) -> bytes:
    return b"PUSH_CANCEL_ACK:" + _validated(PushCancelAck(request_id, transfer_id))


def encode_completion(d_request_id: str, p_tp_size: int) -> bytes:
    """``<D request_id>:<P tp_size>``. Refuses ids a decoder would read as a tagged message."""
    _check_completion_id(d_request_id)
    if type(p_tp_size) is not int or not 1 <= p_tp_size <= MAX_TP_SIZE:
        raise ValueError(f"p_tp_size must be an int in 1..{MAX_TP_SIZE}, got {p_tp_size!r}")
    return f"{d_request_id}:{p_tp_size}".encode()


def encode_completion_with_token(d_request_id: str, p_tp_size: int, token: FirstToken
                                 ) -> bytes:
    """``PUSH_DONE:`` + msgpack: a completion that also carries P's first token."""
    encode_completion(d_request_id, p_tp_size)  # the same checks of id and size
    return b"PUSH_DONE:" + _validated(DoneBody(d_request_id, p_tp_size, token))


def heartbeat_can_carry(transfer_id: object) -> bool:
    """Whether an id fits in a heartbeat (non-empty str without ',', at most MAX_ID_LEN)."""
    return (isinstance(transfer_id, str) and bool(transfer_id) and "," not in transfer_id
            and len(transfer_id) <= MAX_ID_LEN)


def encode_heartbeat(transfer_ids: list[str] | tuple[str, ...]) -> bytes:
    for tid in transfer_ids:
        if not heartbeat_can_carry(tid):
            raise ValueError(f"heartbeat transfer id must be a non-empty str without ',': {tid!r}")
    if len(transfer_ids) > MAX_HEARTBEAT_IDS:
        raise ValueError(f"too many heartbeat ids ({len(transfer_ids)} > {MAX_HEARTBEAT_IDS})")
    return b"HB:" + ",".join(transfer_ids).encode()


def _check_completion_id(request_id: str) -> None:
    if not isinstance(request_id, str) or not request_id or len(request_id) > MAX_ID_LEN:
        raise ValueError(f"request id must be a non-empty str of <= {MAX_ID_LEN}: {request_id!r}")
    if reads_as_tagged(request_id):
        raise ValueError(f"request id {request_id!r} would read as a tagged notification")


def reads_as_tagged(request_id: str) -> bool:
    """Whether a completion for this id would be dispatched as a tagged message (the id is a
    bare tag or begins with one followed by ``:``)."""
    return request_id.split(":", 1)[0] in TAGS


# ---------------------------------------------------------------- decoding


def notif_kind(raw: bytes) -> str:
    """The message kind (a tag from TAGS, or "COMPLETION") without validating the body."""
    head = bytes(raw[:24]).partition(b":")[0]
    return head.decode() if head in _TAG_BYTES else COMPLETION


def decode_notif(raw: bytes) -> Notif:
    """Parse one notification strictly. Raises MalformedNotif and nothing else."""
    try:
        return _decode(raw)
    except MalformedNotif:
        raise
    except Exception as e:  # defence in depth: the contract is "only MalformedNotif"
        raise MalformedNotif(f"{type(e).__name__}: {e}", raw) from None


def _decode(raw: bytes) -> Notif:
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise MalformedNotif(f"not bytes but {type(raw).__name__}")
    raw = bytes(raw)
    if len(raw) > MAX_NOTIF_BYTES:
        raise MalformedNotif(f"{len(raw)} bytes > {MAX_NOTIF_BYTES}", raw)
    head, sep, body = raw.partition(b":")
    if not sep:
        raise MalformedNotif("no ':'", raw)
    if head == b"HB":
        return _decode_heartbeat(body, raw)
    decoder = _BODY_DECODERS.get(head)
    if decoder is not None:
        try:
            msg = decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise MalformedNotif(f"{head.decode()} body: {e}", raw) from None
        if isinstance(msg, DoneBody):
            return _done(msg, raw)
        return msg
    return _decode_completion(raw)


def _done(body: DoneBody, raw: bytes) -> Completion:
    lp = body.first_token.logprobs
    if lp is not None and len(lp.token_ids) != len(lp.logprobs):
        raise MalformedNotif("PUSH_DONE logprobs: token_ids and logprobs differ in length", raw)
    if reads_as_tagged(body.request_id):
        raise MalformedNotif("PUSH_DONE request id reads as a tagged notification", raw)
    return Completion(body.request_id, body.tp_size, body.first_token)


def _decode_heartbeat(body: bytes, raw: bytes) -> Heartbeat:
    text = _utf8(body, raw)
    if not text:
        return Heartbeat(())
    ids = text.split(",")
    if len(ids) > MAX_HEARTBEAT_IDS:
        raise MalformedNotif(f"heartbeat lists {len(ids)} ids > {MAX_HEARTBEAT_IDS}", raw)
    if any(not tid or len(tid) > MAX_ID_LEN for tid in ids):
        raise MalformedNotif("heartbeat has an empty or oversized transfer id", raw)
    return Heartbeat(tuple(ids))


def _decode_completion(raw: bytes) -> Completion:
    text = _utf8(raw, raw)
    request_id, _, tp = text.rpartition(":")
    if not _TP_RE.fullmatch(tp) or int(tp) > MAX_TP_SIZE:
        raise MalformedNotif("completion tp_size is not a canonical positive int", raw)
    if not request_id or len(request_id) > MAX_ID_LEN:
        raise MalformedNotif("completion request id empty or oversized", raw)
    return Completion(request_id, int(tp))


def _utf8(data: bytes, raw: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise MalformedNotif("not UTF-8", raw) from None


# ---------------------------------------------------------------- request ids


def base_request_id(request_id: str) -> str:
    """Strip the trailing ``-<8 lowercase hex>`` engine suffix (engine/frontend/input_processor).

    P and D wrap the proxy's one X-Request-Id into their own core ids that differ only in this
    suffix; stripping it (and nothing else, so a completion index survives) lets P match D's
    registration when no transfer_id is given. An id without the suffix is returned unchanged.
    """
    m = _SUFFIX_RE.match(request_id)
    return m.group(1) if m else request_id
