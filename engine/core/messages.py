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
Output socket frames: an encoded EngineCoreOutputs, the raw ENGINE_CORE_DEAD sentinel
(optionally followed by " " and why, UTF-8, at most MAX_DEAD_REASON bytes), or a heartbeat:
ENGINE_CORE_HB + <f64 seconds the current step has run (0 idle), u64 steps done> (one frame,
every heartbeat interval, from the core's heartbeat thread; engine/core/liveness.py).
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"
ENGINE_CORE_HEARTBEAT = b"ENGINE_CORE_HB"
MAX_DEAD_REASON = 1024
HANDSHAKE_TIMEOUT_S = 300.0
_HEARTBEAT_BODY = struct.Struct("<dQ")
HEARTBEAT_SIZE = len(ENGINE_CORE_HEARTBEAT) + _HEARTBEAT_BODY.size


def encode_dead(reason: str = "") -> bytes:
    """The ENGINE_CORE_DEAD frame, carrying why (truncated) when there is a reason."""
    if not reason:
        return ENGINE_CORE_DEAD
    return ENGINE_CORE_DEAD + b" " + reason.encode("utf-8", "replace")[:MAX_DEAD_REASON]


def decode_dead(frame: bytes) -> str | None:
    """The reason of an ENGINE_CORE_DEAD frame ("" without one); None if it is not one."""
    if frame == ENGINE_CORE_DEAD:
        return ""
    if (len(frame) <= len(ENGINE_CORE_DEAD) + 1 + MAX_DEAD_REASON
            and frame.startswith(ENGINE_CORE_DEAD + b" ")):
        return frame[len(ENGINE_CORE_DEAD) + 1:].decode("utf-8", "replace")
    return None


def encode_heartbeat(step_age_s: float, num_steps: int) -> bytes:
    return ENGINE_CORE_HEARTBEAT + _HEARTBEAT_BODY.pack(step_age_s, num_steps)


def decode_heartbeat(frame: bytes) -> tuple[float, int] | None:
    """(step age, steps done) of a heartbeat frame; None if it is not one."""
    if len(frame) != HEARTBEAT_SIZE or not frame.startswith(ENGINE_CORE_HEARTBEAT):
        return None
    age, steps = _HEARTBEAT_BODY.unpack_from(frame, len(ENGINE_CORE_HEARTBEAT))
    return age, steps


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
                             "debug_prompt_kv", "kv_bindings"})
