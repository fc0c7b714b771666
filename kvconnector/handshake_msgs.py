"""The side channel's typed messages (msgspec msgpack, tagged by ``type``; protocol in
:mod:`kvconnector.handshake`), the metadata they carry, and the compatibility hash.

Requests are decoded strictly (unknown fields and out-of-bound values are errors); every
bytes field a peer sends is bounded.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated

import msgspec

_NonNeg = Annotated[int, msgspec.Meta(ge=0)]
_Pos = Annotated[int, msgspec.Meta(ge=1)]
_Nonce = Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]
_Opt = Annotated[bytes, msgspec.Meta(max_length=64)]
_Endpoint = Annotated[str, msgspec.Meta(max_length=64)]  # "ip:port" / "[ip6]:port"
_ClientId = Annotated[str, msgspec.Meta(max_length=256)]


class AgentMetadata(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """What a peer needs to transfer to/from this rank's KV cache.

    The cache is one region starting at ``base_addr``: block ``b`` occupies
    ``[base_addr + b * bytes_per_block, + bytes_per_block)`` on every layer and for K and V.
    """

    agent_name: str
    agent_blob: bytes  # nixl_agent.get_agent_metadata()
    base_addr: _NonNeg
    num_blocks: _Pos
    bytes_per_block: _Pos
    block_size: _NonNeg  # tokens per block
    tp_rank: _NonNeg
    tp_size: _Pos
    engine_id: str
    compat_hash: str
    physical_blocks_per_logical: _Pos = 1
    mem_type: str = "DRAM"  # "DRAM" (CPU) or "VRAM" (GPU)
    device_id: _NonNeg = 0
    # Where this rank's KV heads lie in a block (kvconnector/tp_layout.HeadLayout), so a peer
    # of another TP size can write just its heads into the right part of our blocks
    # (docs/design.md §8). 0 = not sent (an older engine): whole blocks only.
    num_layers: _NonNeg = 0
    kv_heads: _NonNeg = 0  # this rank's
    first_kv_head: _NonNeg = 0  # the model's index of this rank's first KV head
    total_kv_heads: _NonNeg = 0  # the model's
    head_dim: _NonNeg = 0
    itemsize: _NonNeg = 0


class Hello(msgspec.Struct, tag="HELLO", forbid_unknown_fields=True, frozen=True):
    """Request (with a secret): start a challenge–response with the client's nonce."""

    client_nonce: _Nonce


class GetMeta(msgspec.Struct, tag="GET_META", forbid_unknown_fields=True, frozen=True):
    """Request: the metadata of rank ``tp_rank`` behind this side channel. With a secret the
    nonces of the exchange, the address the client dialled (``endpoint``, "ip:port"), who asks
    (``client_id``, its agent name) and the client's proof over all of them (empty without)."""

    tp_rank: _NonNeg = 0
    client_nonce: _Opt = b""
    server_nonce: _Opt = b""
    proof: _Opt = b""
    endpoint: _Endpoint = ""
    client_id: _ClientId = ""


class Poke(msgspec.Struct, tag="POKE", forbid_unknown_fields=True, frozen=True):
    """Notice (P -> D, no reply): a WRITE into D was posted; D's transfer thread polls its
    agent now, so a waiting D need not poll all the time (kvconnector/poke.py). Carries
    nothing: at worst a forged one makes D poll for a while, as it always did."""


Request = Hello | GetMeta


class Challenge(msgspec.Struct, tag="CHALLENGE", frozen=True):
    server_nonce: bytes


class MetaReply(msgspec.Struct, tag="META", frozen=True):
    meta: AgentMetadata


class SealedMetaReply(msgspec.Struct, tag="SEALED_META", frozen=True):
    """With a secret: msgpack AgentMetadata encrypted and authenticated under a key only
    holders of the secret can derive for this one exchange (:mod:`handshake_auth`)."""

    sealed: bytes


class ErrorReply(msgspec.Struct, tag="ERROR", frozen=True):
    message: str
    code: str = ""  # "refused": no or bad proof / address; "no_secret": we hold no secret


Reply = Challenge | MetaReply | SealedMetaReply | ErrorReply


class HandshakeError(RuntimeError):
    """The handshake with ``peer`` ("host:port") failed; ``cause`` is a short keyword."""

    def __init__(self, peer: str, cause: str, detail: str) -> None:
        super().__init__(f"KV handshake with {peer} failed: {cause}: {detail}")
        self.peer = peer
        self.cause = cause


def compat_hash(model_name: str, dtype: str, num_layers: int, num_kv_heads: int, head_dim: int,
                block_size: int, transfer_mode: str) -> str:
    """Short sha256 over everything two engines must agree on to share KV blocks byte for byte.
    `num_kv_heads` is the model's total, so engines of different TP sizes are compatible."""
    canon = json.dumps(
        {"model": model_name, "dtype": str(dtype), "layers": int(num_layers),
         "kv_heads": int(num_kv_heads), "head_dim": int(head_dim),
         "block_size": int(block_size), "mode": transfer_mode, "layout": "blocks-first-v1"},
        sort_keys=True, separators=(",", ":"),
    )
    return hashlib.sha256(canon.encode()).hexdigest()[:16]
