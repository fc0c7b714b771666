"""Side channel: how two engines learn each other's NIXL agent metadata before any transfer.

Each KV-transfer rank runs one :class:`SideChannelServer` (a ZeroMQ ROUTER bound to an explicit
``host:port``, served by one named daemon thread). A peer asks it with
:func:`fetch_peer_metadata` and receives this rank's :class:`AgentMetadata` — msgspec msgpack
both ways, typed messages, strict decoders, no pickle.

Protocol. Without a KV secret (vLLM-compatible; anyone who reaches the port gets the blob)::

    C -> S  GET_META {tp_rank}
    S -> C  META {meta}

With a KV secret (:class:`~kvconnector.security.KVSecurity`; same secret on every engine), an
HMAC challenge–response in which each side proves it holds the secret, bound to the endpoint
the client dialled and to the client's id, and the metadata sealed for that one exchange
(:mod:`kvconnector.handshake_auth`)::

    C -> S  HELLO {client_nonce}                       32 random bytes
    S -> C  CHALLENGE {server_nonce}                   32 random bytes, single use, 10 s
    C -> S  GET_META {tp_rank, client_nonce, server_nonce, endpoint, client_id,
                      proof = mac("GET_META v2", transcript)}
    S -> C  SEALED_META {ChaCha20-Poly1305(key = mac("META key v2", transcript), meta)}

``endpoint`` is the "ip:port" the client connected to; the server answers only when it is
one of its own addresses and its port (a side channel bound to a wildcard owns every local
interface address). A relay that passes the frames on to a real side channel therefore
gets ``ERROR refused`` (the client named the relay), and never sees the metadata in clear:
only the client of the exchange can open it, and opening it proves the server holds the
secret, so an impostor side channel cannot hand out an agent blob either (a fake D named
in a PUSH_REG cannot make P load an attacker's agent). A GET_META without a valid proof,
with an unknown, reused, expired or foreign nonce, naming an endpoint that is not this
side channel, or from an address outside ``kv_peer_allowlist`` is answered with
``ERROR {code: "refused"}`` and counted in ``refused_count``. A client with a secret refuses a
peer without one (``ERROR {code: "no_secret"}`` or an unsealed META) and a client checks the
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

import ipaddress
import logging
import socket
import threading
from collections.abc import Callable

import msgspec
import psutil
import zmq

from kvconnector.handshake_auth import (
    NonceBook,
    canonical_endpoint,
    check_client_proof,
    seal_meta,
)
from kvconnector.handshake_client import (
    MAX_REPLY_BYTES,
    RefusedHandshakes,
    fetch_peer_metadata,
    zmq_host,
)
from kvconnector.handshake_msgs import (
    AgentMetadata,
    Challenge,
    ErrorReply,
    GetMeta,
    HandshakeError,
    Hello,
    MetaReply,
    Poke,
    Reply,
    Request,
    SealedMetaReply,
    compat_hash,
)
from kvconnector.security import KVSecurity

logger = logging.getLogger(__name__)

POKE = msgspec.to_builtins(Poke())  # {"type": "POKE"}
_POKE_TAG = b"POKE"

__all__ = [
    "MAX_REPLY_BYTES",
    "AgentMetadata",
    "Challenge",
    "ErrorReply",
    "GetMeta",
    "HandshakeError",
    "Hello",
    "MetaReply",
    "RefusedHandshakes",
    "Reply",
    "Request",
    "SideChannelServer",
    "SealedMetaReply",
    "compat_hash",
    "fetch_peer_metadata",
]

_MAX_REQUEST_BYTES = 4096
_START_TIMEOUT_S = 30.0
_LOGGED_REFUSALS = 20


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
        self._own_ips: set[str] | None = set()  # None: bound to a wildcard (_owns)
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"pdserve-kv-side-channel-{port}")
        self._encoder = msgspec.msgpack.Encoder()
        # GET_META alone first: its tag is optional there, as it always was for old clients.
        self._decoder = msgspec.msgpack.Decoder(GetMeta)
        self._hello_decoder = msgspec.msgpack.Decoder(Hello)
        self.on_poke: Callable[[], None] | None = None  # called on the server thread
        self.poked_count = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> SideChannelServer:
        self._thread.start()
        if not self._ready.wait(_START_TIMEOUT_S):
            self._stop.set()
            raise OSError(f"KV side channel on tcp://{self.host}:{self.port} did not start "
                          f"within {_START_TIMEOUT_S:.0f} s")
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

    def _bind(self) -> zmq.Socket:
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST_BYTES)
            sock.setsockopt(zmq.IPV6, ":" in self.host)
            sock.bind(f"tcp://{zmq_host(self.host)}:{self.port or '*'}")
            self.port = int(sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
            self._own_ips = _bound_ips(self.host)
        except BaseException:
            sock.close()
            raise
        self._thread.name = f"pdserve-kv-side-channel-{self.port}"
        return sock

    def _run(self) -> None:
        # Whatever fails before the loop, start() hears of it: it never waits on a dead thread.
        try:
            sock = self._bind()
        except Exception as e:  # noqa: BLE001 - re-raised by start()
            self._start_error = e
            return
        finally:
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
        peer = _peer_address(msg[-1])
        if self._poke(body, peer):
            return  # a notice: no reply
        reply: Reply
        if not self._security.allows(peer):
            reply = self._refuse(peer, f"address {peer} is not in kv_peer_allowlist")
        else:
            try:
                request = self._decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self.malformed_count += 1
                logger.warning("KV side channel %s: malformed request from %s (%s)",
                               self.address, peer, e)
                reply = ErrorReply(f"malformed request: {e}")
            else:
                reply = self._answer(request, peer)
        try:
            sock.send_multipart([*envelope, self._encoder.encode(reply)], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the peer went away; nothing to do
            logger.warning("KV side channel %s: reply not sent (%s)", self.address, e)

    def _poke(self, body: bytes, peer: str) -> bool:
        """A POKE from an allowed peer wakes `on_poke`; True when `body` was one."""
        if _POKE_TAG not in body:  # cheap first: only a notice names it
            return False
        try:
            msg = msgspec.msgpack.decode(body)
        except msgspec.DecodeError:
            return False
        if msg != POKE:  # the tag itself, nothing else (an untagged GET_META is no poke)
            return False
        if self._security.allows(peer):
            self.poked_count += 1
            if self.on_poke is not None:
                self.on_poke()
        else:
            self.refused_count += 1
        return True

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
            if not check_client_proof(sec, request):
                return self._refuse(peer, "wrong proof (kv secrets differ?)")
            if not self._owns(request.endpoint):
                return self._refuse(peer, f"{request.client_id or 'the client'} dialled "
                                          f"{request.endpoint or '?'}, not this side channel "
                                          "(a relay?)")
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
        return SealedMetaReply(seal_meta(sec, request, self._encoder.encode(meta)))

    def _owns(self, endpoint: str) -> bool:
        """Whether a client that dialled `endpoint` reached this very socket: our port, and
        the address we bound (or, bound to a wildcard, an address of a local interface)."""
        host, _, port = endpoint.rpartition(":")
        try:
            if int(port) != self.port:
                return False
            dialled = canonical_endpoint(host, self.port)
        except ValueError:
            return False
        ips = self._own_ips if self._own_ips is not None else _interface_ips()
        return any(canonical_endpoint(ip, self.port) == dialled for ip in ips)

    def _refuse(self, peer: str, why: str) -> ErrorReply:
        self.refused_count += 1
        n = self.refused_count
        if n <= _LOGGED_REFUSALS or n % 1000 == 0:  # a scanner must not flood the log
            logger.warning("KV side channel %s: refused %s: %s (%d refused so far)",
                           self.address, peer, why, n)
        return ErrorReply(why, code="refused")


def _peer_address(frame: zmq.Frame) -> str:
    """The sender's IP as ZeroMQ saw it, an IPv4-mapped IPv6 address as plain IPv4 (so an
    IPv4 allowlist holds on a dual-stack socket); "?" if unknown (refused under an allowlist)."""
    try:
        addr = frame.get("Peer-Address") or "?"
    except zmq.ZMQError:
        return "?"
    try:
        mapped = ipaddress.ip_address(addr)
    except ValueError:
        return addr
    if isinstance(mapped, ipaddress.IPv6Address) and mapped.ipv4_mapped is not None:
        return str(mapped.ipv4_mapped)
    return addr


def _bound_ips(host: str) -> set[str] | None:
    """The IP addresses a socket bound to `host` listens on; None for a wildcard (any local
    interface address, looked up when asked: interfaces come and go)."""
    if host in ("", "*"):
        return None
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)
    except OSError:
        return set()
    ips = {info[4][0] for info in infos}
    if any(ipaddress.ip_address(ip.split("%", 1)[0]).is_unspecified for ip in ips):
        return None
    return ips


def _interface_ips() -> set[str]:
    return {a.address for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family in (socket.AF_INET, socket.AF_INET6)}
