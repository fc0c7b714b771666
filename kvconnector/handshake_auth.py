"""The side channel's challenge–response: proofs, the sealed metadata, the server's nonces.

Used by :mod:`kvconnector.handshake` only when a KV secret is configured (see its module
docstring for the message flow). Everything is bound to the whole exchange, the
*transcript*: both nonces, the TP rank asked for, the endpoint the client dialled ("ip:port",
:func:`canonical_endpoint`) and the client's id. So a relay that passes frames between a
client and a real side channel gets nowhere: the client's proof names the relay's address,
which the server refuses as not its own; and the metadata never crosses in clear:

- client proof ``mac(b"pdserve-kv GET_META v2", transcript)`` (:class:`KVSecurity.mac` over
  length-prefixed parts);
- the server's answer is the metadata sealed with ChaCha20-Poly1305 under the one-exchange key
  ``mac(b"pdserve-kv META key v2", transcript)``: only a holder of the secret who took part
  in this very exchange can derive the key, so only it can read the agent blob (which carries
  the UCX address and memory keys: whoever has it can READ and WRITE the cache), and a
  successful open proves the server holds the secret and saw the same transcript. The key
  is never reused (a fresh server nonce every time), so the AEAD nonce is a constant.

:class:`NonceBook` is owned by the side-channel server thread (no lock). It holds at most
``capacity`` outstanding nonces, each for ``lifetime_s``; a nonce is taken (removed) by the
first GET_META that names it, right or wrong, so it can never be used twice.
"""

from __future__ import annotations

import ipaddress
import os
import time
from collections.abc import Callable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from kvconnector.handshake_msgs import GetMeta
from kvconnector.security import KVSecurity

NONCE_BYTES = 32
_CLIENT_LABEL = b"pdserve-kv GET_META v2"
_KEY_LABEL = b"pdserve-kv META key v2"
_AAD = b"pdserve-kv SEALED_META v2"
_AEAD_NONCE = bytes(12)  # every key seals exactly one message


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def canonical_endpoint(ip: str, port: int) -> str:
    """ "ip:port" (IPv6 as "[ip]:port", IPv4-mapped IPv6 as IPv4): one spelling per address,
    so client and server compare and MAC the same bytes. ValueError for a non-IP host."""
    addr = ipaddress.ip_address(ip.strip("[]").split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return f"[{addr}]:{port}" if addr.version == 6 else f"{addr}:{port}"


def _transcript(req: GetMeta) -> tuple[bytes, ...]:
    return (req.server_nonce, req.client_nonce, str(req.tp_rank).encode(),
            req.endpoint.encode(), req.client_id.encode())


def client_proof(sec: KVSecurity, req: GetMeta) -> bytes:
    """The proof for `req` (its own `proof` field is ignored)."""
    return sec.mac(_CLIENT_LABEL, *_transcript(req))


def check_client_proof(sec: KVSecurity, req: GetMeta) -> bool:
    return sec.verify(req.proof, _CLIENT_LABEL, *_transcript(req))


def _aead(sec: KVSecurity, req: GetMeta) -> ChaCha20Poly1305:
    return ChaCha20Poly1305(sec.mac(_KEY_LABEL, *_transcript(req)))


def seal_meta(sec: KVSecurity, req: GetMeta, meta_bytes: bytes) -> bytes:
    """Server: the metadata for the exchange `req` concluded, readable only by its client."""
    return _aead(sec, req).encrypt(_AEAD_NONCE, meta_bytes, _AAD)


def open_meta(sec: KVSecurity, req: GetMeta, sealed: bytes) -> bytes | None:
    """Client: the metadata sealed for `req`, or None when it was not sealed under this
    exchange's key (another secret, another transcript, or altered on the way)."""
    try:
        return _aead(sec, req).decrypt(_AEAD_NONCE, sealed, _AAD)
    except InvalidTag:
        return None


class NonceBook:
    """Server nonces handed out by CHALLENGE and not used yet: bounded in count and time.

    When full, the oldest nonce gives way (a flood of HELLOs can delay an honest handshake,
    which retries, but can never grow this table)."""

    def __init__(self, capacity: int = 256, lifetime_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.lifetime_s = lifetime_s
        self._clock = clock
        self._issued: dict[bytes, tuple[bytes, float]] = {}  # server nonce -> (client's, expiry)

    def issue(self, client_nonce: bytes) -> bytes:
        now = self._clock()
        self._drop_expired(now)
        while len(self._issued) >= self.capacity:
            del self._issued[next(iter(self._issued))]
        nonce = new_nonce()
        self._issued[nonce] = (client_nonce, now + self.lifetime_s)
        return nonce

    def take(self, server_nonce: bytes, client_nonce: bytes) -> bool:
        """Whether `server_nonce` was issued to `client_nonce` and is still fresh; either way
        it is gone afterwards."""
        entry = self._issued.pop(server_nonce, None)
        return (entry is not None and entry[0] == client_nonce
                and self._clock() < entry[1])

    def __len__(self) -> int:
        return len(self._issued)

    def _drop_expired(self, now: float) -> None:
        for nonce, (_, expiry) in list(self._issued.items()):
            if now >= expiry:
                del self._issued[nonce]
