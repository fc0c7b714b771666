"""The side channel's client: :func:`fetch_peer_metadata` (protocol in
:mod:`kvconnector.handshake`).

Any thread may call it; each call uses its own REQ socket on the shared ZeroMQ context and
returns or raises :class:`HandshakeError` within about ``timeout_s``. Replies are capped at
``MAX_REPLY_BYTES``. The host is resolved once and the connection made to that IP, which is
the endpoint the proof names; with a secret, the metadata is opened (which proves the
server) before it is decoded; with an allowlist, a host outside it is refused before any
connection.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import NoReturn

import msgspec
import zmq

from kvconnector.handshake_auth import canonical_endpoint, client_proof, new_nonce, open_meta
from kvconnector.handshake_msgs import (
    AgentMetadata,
    Challenge,
    ErrorReply,
    GetMeta,
    HandshakeError,
    Hello,
    MetaReply,
    Reply,
    SealedMetaReply,
)
from kvconnector.security import KVSecurity

__all__ = ["MAX_REPLY_BYTES", "RefusedHandshakes", "fetch_peer_metadata", "zmq_host"]

MAX_REPLY_BYTES = 1 << 20  # an agent blob is a few hundred bytes to a few KB


def fetch_peer_metadata(host: str, port: int, expected_compat_hash: str | None,
                        timeout_s: float = 5.0, tp_rank: int = 0,
                        security: KVSecurity | None = None,
                        client_id: str = "") -> AgentMetadata:
    """Ask the side channel at host:port for its metadata; raise HandshakeError on any failure.

    ``expected_compat_hash=None`` skips the compatibility check (tools only). With
    ``security.secret`` the exchange is the challenge–response, bound to the address
    connected to and to ``client_id`` (who asks: our agent name), and the server must prove
    the secret too; with ``security.allowlist`` a host outside it is refused before connecting.
    """
    sec = security or KVSecurity()
    peer = f"{host}:{port}"
    deadline = time.monotonic() + timeout_s
    ip = _resolve(host, port, sec, peer)
    _probe_tcp(ip, port, timeout_s, peer)
    with _Exchange(ip, port, peer, deadline, timeout_s) as ex:
        if not sec.enabled:
            reply = ex.ask(GetMeta(tp_rank=tp_rank))
        else:
            cnonce = new_nonce()
            challenge = ex.ask(Hello(cnonce))
            if not isinstance(challenge, Challenge):
                _raise_for(peer, challenge, "a CHALLENGE")
            ask = GetMeta(tp_rank, cnonce, challenge.server_nonce,
                          endpoint=canonical_endpoint(ip, port), client_id=client_id)
            ask = msgspec.structs.replace(ask, proof=client_proof(sec, ask))
            reply = ex.ask(ask)
            if not isinstance(reply, SealedMetaReply):
                _raise_for(peer, reply, "SEALED_META")
            raw = open_meta(sec, ask, reply.sealed)
            if raw is None:
                raise HandshakeError(peer, "bad proof", "the peer does not prove the kv secret "
                                     "(different secret, or not a real engine)")
            try:
                reply = MetaReply(msgspec.msgpack.decode(raw, type=AgentMetadata))
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                raise HandshakeError(peer, "bad reply", str(e)) from None
    if not isinstance(reply, MetaReply):
        _raise_for(peer, reply, "META")
    meta = reply.meta
    if expected_compat_hash is not None and meta.compat_hash != expected_compat_hash:
        raise HandshakeError(
            peer, "incompatible compat hash",
            f"peer engine {meta.engine_id!r} has {meta.compat_hash}, "
            f"we need {expected_compat_hash} (model, dtype, layers, heads, head_dim, "
            f"block size or transfer mode differ)")
    return meta


class RefusedHandshakes:
    """Counts handshakes this engine's client refused or was refused (no or wrong secret,
    address outside the allowlist), from any handshake thread: ``with counter: fetch(...)``."""

    CAUSES = frozenset({"refused", "bad proof", "not allowed"})

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def __enter__(self) -> RefusedHandshakes:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if getattr(exc, "cause", None) in self.CAUSES:
            with self._lock:
                self.count += 1


def _raise_for(peer: str, reply: Reply, wanted: str) -> NoReturn:
    if isinstance(reply, ErrorReply):
        cause = "refused" if reply.code in ("refused", "no_secret") else "error reply"
        raise HandshakeError(peer, cause, reply.message)
    if isinstance(reply, MetaReply):
        raise HandshakeError(peer, "refused", "the peer has no kv secret configured (it "
                             "answered without proof); set the same --kv-secret on every engine")
    raise HandshakeError(peer, "bad reply", f"{type(reply).__name__} where {wanted} was due")


class _Exchange:
    """One REQ socket to the side channel: send a request, await its reply until the deadline.

    Replies are capped at MAX_REPLY_BYTES: ZeroMQ drops a connection that announces a bigger
    message, which the monitor socket reports at once (no waiting out the deadline, no buffer
    of the announced size)."""

    def __init__(self, host: str, port: int, peer: str, deadline: float,
                 timeout_s: float) -> None:
        self.peer, self.deadline, self.timeout_s = peer, deadline, timeout_s
        ctx = zmq.Context.instance()
        self.sock = ctx.socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
        self.sock.setsockopt(zmq.IPV6, ":" in host)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.endpoint = f"tcp://{zmq_host(host)}:{port}"

    def __enter__(self) -> _Exchange:
        try:
            self.sock.connect(self.endpoint)
        except zmq.ZMQError as e:
            self.close()
            raise HandshakeError(self.peer, "unreachable", str(e)) from None
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ask(self, request: Hello | GetMeta) -> Reply:
        try:
            self.sock.send(msgspec.msgpack.encode(request))
            remaining_ms = max(0, int((self.deadline - time.monotonic()) * 1000))
            ready = dict(self.poller.poll(remaining_ms))
            if self.sock in ready:
                raw = self.sock.recv()
            elif self.monitor in ready:
                raise HandshakeError(self.peer, "bad reply", "connection dropped before the "
                                     f"reply (larger than {MAX_REPLY_BYTES} bytes?)")
            else:
                raise HandshakeError(self.peer, "timeout",
                                     f"no reply within {self.timeout_s:.1f} s")
        except zmq.ZMQError as e:
            raise HandshakeError(self.peer, "unreachable", str(e)) from None
        try:
            return msgspec.msgpack.decode(raw, type=Reply)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise HandshakeError(self.peer, "bad reply", str(e)) from None

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close()
        self.sock.close()


def _resolve(host: str, port: int, sec: KVSecurity, peer: str) -> str:
    """The IP to connect to (the first `host` resolves to); every address it resolves to
    must be inside the allowlist, and the port inside kv_peer_ports (when set)."""
    if sec.ports and not any(lo <= port <= hi for lo, hi in sec.ports):
        raise HandshakeError(peer, "not allowed", f"port {port} is not in kv_peer_ports")
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise HandshakeError(peer, "unreachable", f"cannot resolve: {e}") from None
    addrs = [info[4][0] for info in infos]
    outside = sorted({a for a in addrs if not sec.allows(a)})
    if outside or not addrs:
        raise HandshakeError(peer, "not allowed",
                             f"address {', '.join(outside) or host} is not in kv_peer_allowlist")
    return addrs[0]


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


def zmq_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
