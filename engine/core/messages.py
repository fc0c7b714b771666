"""Messages between a client and an EngineCoreProc that are not in `engine.protocol`.

Handshake (on its own socket; the client binds a ROUTER, the engine connects a DEALER):

    engine                          client
      |--- HandshakeHello ------------>|   the process is up
      |<-- HandshakeInit --------------|   where to connect the input / output sockets
      |    (builds the EngineCore, connects input DEALER + output PUSH,
      |     sends one registration frame on the input DEALER)
      |--- HandshakeReady ------------>|   num_kv_blocks, max_model_len
   or |--- HandshakeFailed ----------->|   the core could not be built (the reason)

Input socket frames: [request type (EngineCoreRequestType value), msgpack body, aux...].
Output socket frames: an encoded EngineCoreOutputs, or the raw ENGINE_CORE_DEAD sentinel.
"""

from __future__ import annotations

from typing import Any

import msgspec

ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"
HANDSHAKE_TIMEOUT_S = 300.0


def engine_identity(engine_index: int) -> bytes:
    """The 2-byte ZeroMQ identity of engine `engine_index` on the input ROUTER."""
    return engine_index.to_bytes(2, "little")


class HandshakeHello(msgspec.Struct, tag="HELLO"):
    engine_index: int
    pid: int


class HandshakeInit(msgspec.Struct, tag="INIT"):
    input_address: str
    output_address: str
    # Data parallel: where to PUSH stats to the coordinator and SUBscribe to its waves
    # ("" = no coordinator).
    coordinator_engine_in: str = ""
    coordinator_wave_pub: str = ""


class HandshakeReady(msgspec.Struct, tag="READY"):
    num_kv_blocks: int
    max_model_len: int
    supported_tasks: list[str] = []


class HandshakeFailed(msgspec.Struct, tag="FAILED"):
    error: str


HandshakeMessage = HandshakeHello | HandshakeInit | HandshakeReady | HandshakeFailed

_handshake_encoder = msgspec.msgpack.Encoder()
_handshake_decoder = msgspec.msgpack.Decoder(HandshakeMessage)


def encode_handshake(msg: HandshakeMessage) -> bytes:
    return _handshake_encoder.encode(msg)


def decode_handshake(data: bytes) -> HandshakeMessage:
    """Strict: raises msgspec errors on anything that is not a handshake message."""
    return _handshake_decoder.decode(data)


class UtilityCall(msgspec.Struct, array_like=True):
    """Body of a UTILITY message: run `method(*args)` on the core, reply with `call_id`."""

    call_id: int
    method: str
    args: list[Any] = []


# Requests for which the core thread runs a utility method (allow-list, no getattr games).
UTILITY_METHODS = frozenset({"reset_prefix_cache", "get_supported_tasks", "get_stats",
                             "debug_prompt_kv"})
