"""Typed messages between the executor (EngineCore process) and its workers (msgpack).

An RPC carries the method name, the rank that must answer (`reply_rank`, -1 = every rank)
and the argument as raw msgpack, decoded by the worker with the type `RPC_TYPES` names for
that method; the reply carries the result the same way. Nothing is pickled.
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine.connector_api import KVCacheSpec
from engine.connector_seam import KVBinding
from engine.executor.shm_broadcast import RingHandle
from engine.runner_output import ModelRunnerOutput

ALL_RANKS = -1


class RpcCall(msgspec.Struct, array_like=True):
    method: str
    reply_rank: int
    arg: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack nil


class RpcReply(msgspec.Struct, array_like=True):
    rank: int
    error: str | None = None
    result: msgspec.Raw = msgspec.Raw(b"\xc0")


class WorkerInfo(msgspec.Struct, array_like=True):
    """What a worker reports after loading its shard (the `describe` setup call)."""

    rank: int
    pid: int
    num_kv_blocks: int
    max_model_len: int
    num_heads: int
    num_kv_heads: int
    torch_threads: int
    kv_binding: KVBinding | None = None  # what its connector worker half bound
    collectives: str = "gloo"  # the TP layers' all-reduce: "shm" (shm_collectives) or "gloo"
    wakes: bool = False  # its connector worker half rings the executor's wake bell


class WorkerReady(msgspec.Struct, array_like=True, tag=True):
    """Over the ready pipe: the worker's response-queue handle."""

    rank: int
    pid: int
    response_handle: RingHandle


class WorkerFailed(msgspec.Struct, array_like=True, tag=True):
    rank: int
    error: str


# method -> (argument type, result type); None: no argument.
RPC_TYPES: dict[str, tuple[Any, Any]] = {
    # the worker decodes the SchedulerOutput itself, typed by its connector's metadata
    "execute_model": (msgspec.Raw, ModelRunnerOutput),
    "describe": (None, WorkerInfo),
    "num_requests": (None, int),
    "kv_cache_spec": (None, KVCacheSpec),  # with a KV connector: rank 0's layout
    "kv_table_sizes": (None, dict[str, int]),  # the rank's connector tables (leak checks)
    "kv_stats": (None, dict[str, float]),  # the rank's connector counters, now (stats)
    "shutdown": (None, None),
}

_encoder = msgspec.msgpack.Encoder()
_call_decoder = msgspec.msgpack.Decoder(RpcCall)
_reply_decoder = msgspec.msgpack.Decoder(RpcReply)
_startup_decoder = msgspec.msgpack.Decoder(WorkerReady | WorkerFailed)
_typed = {t: msgspec.msgpack.Decoder(t) for pair in RPC_TYPES.values() for t in pair if t}


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def encode_call(method: str, arg: Any, reply_rank: int) -> bytes:
    if method not in RPC_TYPES:
        raise ValueError(f"unknown worker RPC {method!r}")
    return _encoder.encode(RpcCall(method, reply_rank, msgspec.Raw(_encoder.encode(arg))))


def decode_call(data: bytes) -> tuple[RpcCall, Any]:
    call = _call_decoder.decode(data)
    arg_type = RPC_TYPES[call.method][0]
    return call, (None if arg_type is None else _typed[arg_type].decode(call.arg))


def encode_reply(rank: int, method: str, result: Any = None, error: str | None = None) -> bytes:
    return _encoder.encode(RpcReply(rank, error, msgspec.Raw(_encoder.encode(result))))


def decode_reply(method: str, data: bytes) -> RpcReply | Any:
    """The result, or the RpcReply itself when it carries an error."""
    reply = _reply_decoder.decode(data)
    if reply.error is not None:
        return reply
    result_type = RPC_TYPES[method][1]
    return None if result_type is None else _typed[result_type].decode(reply.result)


def decode_startup(data: bytes) -> WorkerReady | WorkerFailed:
    return _startup_decoder.decode(data)
