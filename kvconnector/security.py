"""KV-path security settings: the shared secret and the peer allowlist (docs/security.md).

One :class:`KVSecurity` per connector, built once from the kv-transfer config at start-up and
never mutated (any thread may read it). Sources, first wins: ``kv_connector_extra_config``
``kv_secret`` (the ``--kv-secret`` flag lands there), then the ``PDSERVE_KV_SECRET``
environment variable. ``kv_peer_allowlist`` is a list of CIDRs (or one comma-separated
string); empty means any address. ``kv_peer_ports`` is a list of ports and "lo-hi" ranges (or
one comma-separated string) a side channel may be dialled on; empty means any port. Both
hold for every side channel this engine dials — the ones a D leg names (checked at
admission, before anything is dialled) and the reverse handshake P makes with a D.

Without a secret the engine behaves as vLLM's connectors do (anyone who reaches the side
channel may transfer); :func:`KVSecurity.from_config` logs one loud warning then.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

SECRET_ENV = "PDSERVE_KV_SECRET"
MIN_SECRET_BYTES = 16
_Net = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class KVSecurity:
    secret: bytes | None = None
    allowlist: tuple[_Net, ...] = ()
    ports: tuple[tuple[int, int], ...] = ()  # inclusive ranges; empty: any

    def __post_init__(self) -> None:
        if self.secret is not None and len(self.secret) < MIN_SECRET_BYTES:
            raise ValueError(f"kv secret must be at least {MIN_SECRET_BYTES} bytes long "
                             f"(got {len(self.secret)})")

    @classmethod
    def from_extra(cls, extra: dict[str, Any], *, warn: bool = True) -> KVSecurity:
        raw = extra.get("kv_secret") or os.environ.get(SECRET_ENV) or None
        if raw is not None and not isinstance(raw, str):
            raise ValueError("kv_secret must be a string")
        nets = extra.get("kv_peer_allowlist") or ()
        if isinstance(nets, str):
            nets = [n for n in (s.strip() for s in nets.split(",")) if n]
        if not isinstance(nets, (list, tuple)) or not all(isinstance(n, str) for n in nets):
            raise ValueError("kv_peer_allowlist must be a list of CIDR strings")
        try:
            allow = tuple(ipaddress.ip_network(n, strict=False) for n in nets)
        except ValueError as e:
            raise ValueError(f"kv_peer_allowlist: {e}") from None
        sec = cls(raw.encode() if raw else None, allow, _port_ranges(extra.get("kv_peer_ports")))
        if warn and sec.secret is None:
            logger.warning("NO KV SECRET CONFIGURED: any host that reaches this engine's KV "
                           "side channel can read and overwrite its KV cache. Set --kv-secret "
                           "or %s on every prefill and decode engine (docs/security.md).",
                           SECRET_ENV)
        return sec

    @classmethod
    def from_config(cls, kv: Any, *, warn: bool = True) -> KVSecurity:
        """From a KVTransferConfig (or None: no security)."""
        return cls.from_extra(kv.kv_connector_extra_config if kv is not None else {}, warn=warn)

    @property
    def enabled(self) -> bool:
        return self.secret is not None

    def allows(self, host: str) -> bool:
        """Whether a peer at this IP address may talk to us (a hostname is resolved by the
        caller; an unparsable address is refused when an allowlist is set)."""
        if not self.allowlist:
            return True
        try:
            ip = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            return False
        return any(ip in net for net in self.allowlist)

    def check_side_channel(self, host: str, port: int, field: str = "kv_transfer_params") -> None:
        """Refuse (ValueError naming `field`) a side channel we must not dial: a port
        outside ``kv_peer_ports`` or an address outside ``kv_peer_allowlist`` (a hostname
        must resolve inside it). Without either setting every address passes."""
        if self.ports and not any(lo <= port <= hi for lo, hi in self.ports):
            raise ValueError(f"{field}.remote_port: {port} is not in kv_peer_ports")
        if not self.allowlist:
            return
        try:
            addrs = {i[4][0] for i in socket.getaddrinfo(host.strip("[]"), port,
                                                         type=socket.SOCK_STREAM)}
        except OSError as e:
            raise ValueError(f"{field}.remote_host: cannot resolve {host!r}: {e}") from None
        if not addrs or not all(self.allows(a) for a in addrs):
            raise ValueError(f"{field}.remote_host: {host} is not in kv_peer_allowlist")

    def mac(self, *parts: bytes) -> bytes:
        """HMAC-SHA256 over length-prefixed parts (no two part lists give the same input)."""
        if self.secret is None:
            raise RuntimeError("no kv secret configured")
        h = hmac.new(self.secret, digestmod=hashlib.sha256)
        for p in parts:
            h.update(len(p).to_bytes(8, "big"))
            h.update(p)
        return h.digest()

    def verify(self, tag: bytes, *parts: bytes) -> bool:
        return self.secret is not None and hmac.compare_digest(tag, self.mac(*parts))


def prompt_digest(token_ids: Any) -> str:
    """Hex digest of a prompt's token ids: what PUSH_REG and signed pull params bind to."""
    data = np.asarray(list(token_ids), dtype="<i4").tobytes()
    return hashlib.sha256(data).hexdigest()[:32]


def _port_ranges(raw: Any) -> tuple[tuple[int, int], ...]:
    """`kv_peer_ports`: ints, "lo-hi" ranges, or one comma-separated string of them."""
    if raw is None or raw == "":
        return ()
    items = raw.split(",") if isinstance(raw, str) else raw
    if not isinstance(items, (list, tuple)):
        raise ValueError("kv_peer_ports must be a list of ports or 'lo-hi' ranges")
    out = []
    for item in items:
        try:
            lo, _, hi = str(item).strip().partition("-")
            rng = (int(lo), int(hi or lo))
        except ValueError:
            raise ValueError(f"kv_peer_ports: {item!r} is not a port or 'lo-hi' range") from None
        if isinstance(item, bool) or not 1 <= rng[0] <= rng[1] <= 65535:
            raise ValueError(f"kv_peer_ports: {item!r} is not a port or 'lo-hi' range")
        out.append(rng)
    return tuple(out)
