"""Side channel: how two engines learn each other's NIXL agent metadata before any transfer.

Each KV-transfer rank runs one :class:`SideChannelServer` (a ZeroMQ ROUTER bound to an explicit
``host:port``, served by one named daemon thread). A peer asks it with
:func:`fetch_peer_metadata` and receives this rank's :class:`AgentMetadata` — msgspec msgpack
both ways, typed messages, strict decoders, no pickle.

Protocol. Without a KV secret (vLLM-compatible; anyone who reaches the port gets the blob)::

    C -> S  GET_META {tp_rank}
    S -> C  META {meta}

With a KV secret (:class:`~kvconnector.security.KVSecurity`; same secret on every engine), an
HMAC challenge–response in which each side proves it holds the secret (proofs in
:mod:`kvconnector.handshake_auth`)::

    C -> S  HELLO {client_nonce}                       32 random bytes
    S -> C  CHALLENGE {server_nonce}                   32 random bytes, single use, 10 s
    C -> S  GET_META {tp_rank, client_nonce, server_nonce,
                      proof = mac("GET_META", server_nonce, client_nonce, tp_rank)}
    S -> C  SIGNED_META {meta = msgpack(AgentMetadata),
                         proof = mac("META", client_nonce, server_nonce, meta)}

The client checks the server's proof before it decodes the metadata, so a side channel that
does not know the secret cannot hand out an agent blob (a fake D named in a PUSH_REG cannot
make P load an attacker's agent). A GET_META without a valid proof, with an unknown, reused,
expired or foreign nonce, or from an address outside ``kv_peer_allowlist`` is answered with
``ERROR {code: "refused"}`` and counted in ``refused_count``. A client with a secret refuses a
peer without one (``ERROR {code: "no_secret"}`` or an unsigned META) and a client checks the
allowlist before it connects.

Invariants:
- The server thread never dies of a bad message: anything that does not decode as a request is
  counted in ``malformed_count`` and answered with an :class:`ErrorReply` (or dropped when the
  ZeroMQ envelope itself is unusable); the server keeps answering afterwards. Requests are
  capped at 4 KiB, replies the client accepts at 1 MiB (an agent blob is well under 10 KB).
- :func:`fetch_peer_metadata` either returns metadata whose ``compat_hash`` equals the expected
  one or raises :class:`HandshakeError` naming the peer ``host:port`` and the cause
  (unreachable, timeout, not allowed, refused, bad proof, error reply, bad reply, incompatible
  compat hash), within about ``timeout_s``.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from kvconnector.handshake_auth import (
    NonceBook,
    check_client_proof,
    check_server_proof,
    client_proof,
    new_nonce,
    server_proof,
)
from kvconnector.handshake_msgs import (
    AgentMetadata,
    Challenge,
    ErrorReply,
    GetMeta,
    HandshakeError,
    Hello,
    MetaReply,
    Reply,
    Request,
    SignedMetaReply,
    compat_hash,
)
from kvconnector.security import KVSecurity

logger = logging.getLogger(__name__)

__all__ = [
    "AgentMetadata",
    "Challenge",
    "ErrorReply",
    "GetMeta",
    "HandshakeError",
    "Hello",
    "MetaReply",
    "SignedMetaReply",
    "SideChannelServer",
    "compat_hash",
    "fetch_peer_metadata",
]

_MAX_REQUEST_BYTES = 4096
MAX_REPLY_BYTES = 1 << 20  # an agent blob is a few hundred bytes to a few KB


class SideChannelServer:
    """Answers GET_META on ``tcp://host:port`` from a named daemon thread.

    ``metadata_provider()`` is called on the server thread for every request, so it must be
    thread-safe (returning a prebuilt struct is). ``port=0`` binds a free port; the bound port is
    in ``self.port`` once :meth:`start` returns. Bind errors are raised from :meth:`start`.
    With ``security.secret`` set, metadata only goes to a client that proves it holds the
    secret; with ``security.allowlist`` set, only to addresses inside it (module docstring).
    The counters are written by the server thread only and read by anyone.
    """

    def __init__(self, host: str, port: int,
                 metadata_provider: Callable[[], AgentMetadata],
                 security: KVSecurity | None = None) -> None:
        self.host = host
        self.port = port
        self._provider = metadata_provider
        self._security = security or KVSecurity()
        self._nonces = NonceBook()
        self.malformed_count = 0
        self.refused_count = 0
        self.served_count = 0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"pdserve-kv-side-channel-{port}")
        self._encoder = msgspec.msgpack.Encoder()
        # GET_META alone first: its tag is optional there, as it always was for old clients.
        self._decoder = msgspec.msgpack.Decoder(GetMeta)
        self._hello_decoder = msgspec.msgpack.Decoder(Hello)

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
        logger.info("KV side channel listening on %s (%s)", self.address,
                    "secret required" if self._security.enabled else "NO secret")
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
        msg = sock.recv_multipart(copy=False)
        frames = [f.bytes for f in msg]
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
        peer = msg[-1].get("Peer-Address") or "?"
        try:
            request = self._decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.malformed_count += 1
            logger.warning("KV side channel %s: malformed request from %s (%s)",
                           self.address, peer, e)
            reply: Reply = ErrorReply(f"malformed request: {e}")
        else:
            reply = self._answer(request, peer)
        try:
            sock.send_multipart([*envelope, self._encoder.encode(reply)], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the peer went away; nothing to do
            logger.warning("KV side channel %s: reply not sent (%s)", self.address, e)

    def _decode(self, body: bytes) -> Request:
        try:
            return self._decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            try:
                return self._hello_decoder.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError):
                raise e from None

    def _answer(self, request: Hello | GetMeta, peer: str) -> Reply:
        sec = self._security
        if not sec.allows(peer):
            return self._refuse(peer, f"address {peer} is not in kv_peer_allowlist")
        if isinstance(request, Hello):
            if not sec.enabled:
                logger.warning("KV side channel %s: %s wants an authenticated handshake but "
                               "this engine has no kv secret", self.address, peer)
                return ErrorReply("this engine has no kv secret configured; set the same "
                                  "--kv-secret on every engine", code="no_secret")
            return Challenge(self._nonces.issue(request.client_nonce))
        if sec.enabled:
            if not request.proof:
                return self._refuse(peer, "kv secret required: start with HELLO and prove it "
                                          "(set the same --kv-secret on every engine)")
            fresh = self._nonces.take(request.server_nonce, request.client_nonce)
            if not fresh:
                return self._refuse(peer, "unknown, used or expired challenge nonce")
            if not check_client_proof(sec, request.proof, request.server_nonce,
                                      request.client_nonce, request.tp_rank):
                return self._refuse(peer, "wrong proof (kv secrets differ?)")
        try:
            meta = self._provider()
        except Exception as e:  # a provider bug is an answer, not a dead thread
            logger.exception("KV side channel %s: metadata provider failed", self.address)
            return ErrorReply(f"metadata unavailable: {e}")
        if request.tp_rank != meta.tp_rank:
            return ErrorReply(f"this side channel serves tp_rank {meta.tp_rank}, "
                              f"not {request.tp_rank}")
        self.served_count += 1
        if not sec.enabled:
            return MetaReply(meta)
        raw = self._encoder.encode(meta)
        return SignedMetaReply(raw, server_proof(sec, request.client_nonce,
                                                 request.server_nonce, raw))

    def _refuse(self, peer: str, why: str) -> ErrorReply:
        self.refused_count += 1
        logger.warning("KV side channel %s: refused %s: %s", self.address, peer, why)
        return ErrorReply(why, code="refused")


def fetch_peer_metadata(host: str, port: int, expected_compat_hash: str | None,
                        timeout_s: float = 5.0, tp_rank: int = 0,
                        security: KVSecurity | None = None) -> AgentMetadata:
    """Ask the side channel at host:port for its metadata; raise HandshakeError on any failure.

    ``expected_compat_hash=None`` skips the compatibility check (tools only). With
    ``security.secret`` the exchange is the challenge–response and the server must prove the
    secret too; with ``security.allowlist`` a host outside it is refused before connecting.
    """
    sec = security or KVSecurity()
    peer = f"{host}:{port}"
    deadline = time.monotonic() + timeout_s
    _check_allowed(host, port, sec, peer)
    _probe_tcp(host, port, timeout_s, peer)
    with _Exchange(host, port, peer, deadline, timeout_s) as ex:
        if not sec.enabled:
            reply = ex.ask(GetMeta(tp_rank=tp_rank))
        else:
            cnonce = new_nonce()
            challenge = ex.ask(Hello(cnonce))
            if not isinstance(challenge, Challenge):
                _raise_for(peer, challenge, "a CHALLENGE")
            snonce = challenge.server_nonce
            reply = ex.ask(GetMeta(tp_rank, cnonce, snonce,
                                   client_proof(sec, snonce, cnonce, tp_rank)))
            if not isinstance(reply, SignedMetaReply):
                _raise_for(peer, reply, "SIGNED_META")
            if not check_server_proof(sec, reply.proof, cnonce, snonce, reply.meta):
                raise HandshakeError(peer, "bad proof", "the peer does not prove the kv secret "
                                     "(different secret, or not a real engine)")
            try:
                reply = MetaReply(msgspec.msgpack.decode(reply.meta, type=AgentMetadata))
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


def _raise_for(peer: str, reply: Reply, wanted: str) -> None:
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
        self.endpoint = f"tcp://{_zmq_host(host)}:{port}"

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


def _check_allowed(host: str, port: int, sec: KVSecurity, peer: str) -> None:
    """Every address `host` resolves to must be inside the allowlist (when one is set)."""
    if not sec.allowlist:
        return
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    except OSError as e:
        raise HandshakeError(peer, "unreachable", f"cannot resolve: {e}") from None
    outside = sorted(a for a in addrs if not sec.allows(a))
    if outside or not addrs:
        raise HandshakeError(peer, "not allowed",
                             f"address {', '.join(outside) or host} is not in kv_peer_allowlist")


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
