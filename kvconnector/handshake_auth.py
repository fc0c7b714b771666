"""The side channel's HMAC challenge–response: proofs and the server's single-use nonces.

Used by :mod:`kvconnector.handshake` only when a KV secret is configured (see its module
docstring for the message flow). Both proofs are :meth:`KVSecurity.mac` over length-prefixed
parts, each under its own label, so a client proof can never be replayed as a server proof
(or the other way round), and each binds both nonces:

- client proof ``mac(b"pdserve-kv GET_META v1", server_nonce, client_nonce, tp_rank)``;
- server proof ``mac(b"pdserve-kv META v1", client_nonce, server_nonce, meta_bytes)`` — it also
  binds the exact metadata bytes, so nobody between the two can swap the agent blob.

:class:`NonceBook` is owned by the side-channel server thread (no lock). It holds at most
``capacity`` outstanding nonces, each for ``lifetime_s``; a nonce is taken (removed) by the
first GET_META that names it, right or wrong, so it can never be used twice.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from kvconnector.security import KVSecurity

NONCE_BYTES = 32
_CLIENT_LABEL = b"pdserve-kv GET_META v1"
_SERVER_LABEL = b"pdserve-kv META v1"


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def client_proof(sec: KVSecurity, server_nonce: bytes, client_nonce: bytes,
                 tp_rank: int) -> bytes:
    return sec.mac(_CLIENT_LABEL, server_nonce, client_nonce, str(tp_rank).encode())


def server_proof(sec: KVSecurity, client_nonce: bytes, server_nonce: bytes,
                 meta_bytes: bytes) -> bytes:
    return sec.mac(_SERVER_LABEL, client_nonce, server_nonce, meta_bytes)


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


def check_client_proof(sec: KVSecurity, proof: bytes, server_nonce: bytes, client_nonce: bytes,
                       tp_rank: int) -> bool:
    return sec.verify(proof, _CLIENT_LABEL, server_nonce, client_nonce, str(tp_rank).encode())


def check_server_proof(sec: KVSecurity, proof: bytes, client_nonce: bytes, server_nonce: bytes,
                       meta_bytes: bytes) -> bool:
    return sec.verify(proof, _SERVER_LABEL, client_nonce, server_nonce, meta_bytes)
