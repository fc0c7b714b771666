"""Side channel: how two engines learn each other's NIXL agent metadata before any transfer.

Each KV-transfer rank runs one :class:`SideChannelServer` (a ZeroMQ ROUTER bound to an explicit
``host:port``, served by one named daemon thread). A peer asks it with
:func:`fetch_peer_metadata`, which sends a typed ``GET_META`` request and receives this rank's
:class:`AgentMetadata` — msgspec msgpack both ways, no pickle.

Invariants:
- The server thread never dies of a bad message: anything that does not decode as a request is
  counted in ``malformed_count`` and answered with an :class:`ErrorReply` (or dropped when the
  ZeroMQ envelope itself is unusable); the server keeps answering afterwards.
- :func:`fetch_peer_metadata` either returns metadata whose ``compat_hash`` equals the expected
  one or raises :class:`HandshakeError` naming the peer ``host:port`` and the cause
  (unreachable, timeout, error reply, bad reply, incompatible compat hash), within about
  ``timeout_s``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Annotated

import msgspec
import zmq

logger = logging.getLogger(__name__)

__all__ = [
    "AgentMetadata",
    "ErrorReply",
    "GetMeta",
    "HandshakeError",
    "MetaReply",
    "SideChannelServer",
    "compat_hash",
    "fetch_peer_metadata",
]

_NonNeg = Annotated[int, msgspec.Meta(ge=0)]
_Pos = Annotated[int, msgspec.Meta(ge=1)]
_MAX_REQUEST_BYTES = 4096


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


class GetMeta(msgspec.Struct, tag="GET_META", forbid_unknown_fields=True, frozen=True):
    """Request: the metadata of rank ``tp_rank`` behind this side channel."""

    tp_rank: _NonNeg = 0


class MetaReply(msgspec.Struct, tag="META", frozen=True):
    meta: AgentMetadata


class ErrorReply(msgspec.Struct, tag="ERROR", frozen=True):
    message: str


Reply = MetaReply | ErrorReply


class HandshakeError(RuntimeError):
    """The handshake with ``peer`` ("host:port") failed; ``cause`` is a short keyword."""

    def __init__(self, peer: str, cause: str, detail: str) -> None:
        super().__init__(f"KV handshake with {peer} failed: {cause}: {detail}")
        self.peer = peer
        self.cause = cause


def compat_hash(model_name: str, dtype: str, num_layers: int, num_kv_heads: int, head_dim: int,
                block_size: int, transfer_mode: str) -> str:
    """Short sha256 over everything two engines must agree on to share KV blocks byte for byte."""
    canon = json.dumps(
        {"model": model_name, "dtype": str(dtype), "layers": int(num_layers),
         "kv_heads": int(num_kv_heads), "head_dim": int(head_dim),
         "block_size": int(block_size), "mode": transfer_mode, "layout": "blocks-first-v1"},
        sort_keys=True, separators=(",", ":"),
    )
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


class SideChannelServer:
    """Answers GET_META on ``tcp://host:port`` from a named daemon thread.

    ``metadata_provider()`` is called on the server thread for every request, so it must be
    thread-safe (returning a prebuilt struct is). ``port=0`` binds a free port; the bound port is
    in ``self.port`` once :meth:`start` returns. Bind errors are raised from :meth:`start`.
    """

    def __init__(self, host: str, port: int,
                 metadata_provider: Callable[[], AgentMetadata]) -> None:
        self.host = host
        self.port = port
        self._provider = metadata_provider
        self.malformed_count = 0
        self.served_count = 0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"pdserve-kv-side-channel-{port}")
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(GetMeta)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> SideChannelServer:
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self._thread.join()
            raise OSError(f"KV side channel cannot bind tcp://{self.host}:{self.port}: "
                          f"{self._start_error}") from self._start_error
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def __enter__(self) -> SideChannelServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST_BYTES)
        sock.setsockopt(zmq.IPV6, ":" in self.host)
        try:
            endpoint = f"tcp://{_zmq_host(self.host)}:{self.port or '*'}"
            sock.bind(endpoint)
            self.port = int(sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
        except zmq.ZMQError as e:
            self._start_error = e
            sock.close()
            self._ready.set()
            return
        self._thread.name = f"pdserve-kv-side-channel-{self.port}"
        self._ready.set()
        logger.info("KV side channel listening on %s", self.address)
        try:
            while not self._stop.is_set():
                if sock.poll(100, zmq.POLLIN):
                    try:
                        self._serve_one(sock)
                    except Exception:  # the thread outlives any single bad exchange
                        self.malformed_count += 1
                        logger.exception("KV side channel %s: request failed", self.address)
        finally:
            sock.close()
            logger.info("KV side channel on %s stopped", self.address)

    def _serve_one(self, sock: zmq.Socket) -> None:
        frames = sock.recv_multipart()
        # A REQ peer sends [identity, b"", body]; a DEALER may send [identity, body].
        if len(frames) == 3 and frames[1] == b"":
            envelope, body = frames[:2], frames[2]
        elif len(frames) == 2:
            envelope, body = frames[:1], frames[1]
        else:
            self.malformed_count += 1
            logger.warning("KV side channel %s: dropped a %d-frame message",
                           self.address, len(frames))
            return
        try:
            request = self._decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.malformed_count += 1
            logger.warning("KV side channel %s: malformed request (%s)", self.address, e)
            reply: Reply = ErrorReply(f"malformed request: {e}")
        else:
            reply = self._answer(request)
        try:
            sock.send_multipart([*envelope, self._encoder.encode(reply)], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the peer went away; nothing to do
            logger.warning("KV side channel %s: reply not sent (%s)", self.address, e)

    def _answer(self, request: GetMeta) -> Reply:
        try:
            meta = self._provider()
        except Exception as e:  # a provider bug is an answer, not a dead thread
            logger.exception("KV side channel %s: metadata provider failed", self.address)
            return ErrorReply(f"metadata unavailable: {e}")
        if request.tp_rank != meta.tp_rank:
            return ErrorReply(f"this side channel serves tp_rank {meta.tp_rank}, "
                              f"not {request.tp_rank}")
        self.served_count += 1
        return MetaReply(meta)


def fetch_peer_metadata(host: str, port: int, expected_compat_hash: str | None,
                        timeout_s: float = 5.0, tp_rank: int = 0) -> AgentMetadata:
    """Ask the side channel at host:port for its metadata; raise HandshakeError on any failure.

    ``expected_compat_hash=None`` skips the compatibility check (tools only).
    """
    peer = f"{host}:{port}"
    deadline = time.monotonic() + timeout_s
    _probe_tcp(host, port, timeout_s, peer)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IPV6, ":" in host)
    try:
        sock.connect(f"tcp://{_zmq_host(host)}:{port}")
        sock.send(msgspec.msgpack.encode(GetMeta(tp_rank=tp_rank)))
        remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
        if not sock.poll(remaining_ms, zmq.POLLIN):
            raise HandshakeError(peer, "timeout", f"no reply within {timeout_s:.1f} s")
        raw = sock.recv()
    except zmq.ZMQError as e:
        raise HandshakeError(peer, "unreachable", str(e)) from None
    finally:
        sock.close()
    try:
        reply = msgspec.msgpack.decode(raw, type=Reply)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise HandshakeError(peer, "bad reply", str(e)) from None
    if isinstance(reply, ErrorReply):
        raise HandshakeError(peer, "error reply", reply.message)
    meta = reply.meta
    if expected_compat_hash is not None and meta.compat_hash != expected_compat_hash:
        raise HandshakeError(
            peer, "incompatible compat hash",
            f"peer engine {meta.engine_id!r} has {meta.compat_hash}, "
            f"we need {expected_compat_hash} (model, dtype, layers, heads, head_dim, "
            f"block size or transfer mode differ)")
    return meta


def _probe_tcp(host: str, port: int, timeout_s: float, peer: str) -> None:
    """Fail fast on a closed port: ZeroMQ's connect never fails, it silently retries."""
    try:
        with socket.create_connection((host, port), timeout=max(0.05, timeout_s)):
            pass
    except ConnectionRefusedError:
        raise HandshakeError(peer, "unreachable", "connection refused") from None
    except TimeoutError:
        raise HandshakeError(peer, "timeout", f"no TCP connect within {timeout_s:.1f} s") from None
    except OSError as e:
        raise HandshakeError(peer, "unreachable", str(e)) from None


def _zmq_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
