"""The record an engine keeps in etcd while it serves, and how a proxy judges one.

Key:   /pdserve/<cluster>/engines/<lease id, hex>   (under the engine's lease: the key goes
       when the lease lapses - SIGKILL, partition - or is revoked - SIGTERM)
Value: JSON {"cluster", "role", "url", "model", "kv": /kv_transfer/info or null, "sig"?}

`role` is an opaque string to the engine; a proxy routes "prefill", "decode" and "both".
With a secret (the KV secret), `sig` is HMAC-SHA256(secret, key || canonical JSON of the
rest): a writer to etcd without the secret can neither make a proxy send traffic (prompts)
to its URL nor copy a signed record under another key. Verification is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

ROUTED_ROLES = ("prefill", "decode", "both")
MAX_VALUE_BYTES = 64 * 1024


def cluster_prefix(cluster: str) -> bytes:
    return f"/pdserve/{cluster}/".encode()


def engine_key(cluster: str, lease: int) -> bytes:
    return cluster_prefix(cluster) + f"engines/{lease:x}".encode()


class Rejected(Exception):
    """A record no proxy may route to; `reason` is the metric label, the message the detail."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Registration:
    cluster: str
    role: str
    url: str
    model: str
    kv: dict[str, Any] | None

    def fields(self) -> dict[str, Any]:
        return {"cluster": self.cluster, "role": self.role, "url": self.url,
                "model": self.model, "kv": self.kv}

    def encode(self, key: bytes, secret: bytes | None) -> bytes:
        body = self.fields()
        if secret is not None:
            body["sig"] = _mac(secret, key, body)
        return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()

    def kv_endpoints(self) -> list[tuple[str, int]]:
        """Every side channel the record names (each DP rank's, each TP rank's port)."""
        if not self.kv:
            return []
        groups = self.kv.get("data_parallel_ranks") or [self.kv]
        return [(g["kv_host"], int(p)) for g in groups
                for p in (g.get("kv_ports") or [g["kv_port"]])]


def _canonical(key: bytes, body: dict[str, Any]) -> bytes:
    fields = {k: v for k, v in body.items() if k != "sig"}
    return key + b"\0" + json.dumps(fields, separators=(",", ":"), sort_keys=True).encode()


def _mac(secret: bytes, key: bytes, body: dict[str, Any]) -> str:
    return hmac.new(secret, _canonical(key, body), hashlib.sha256).hexdigest()


def decode(key: bytes, value: bytes, *, cluster: str, secret: bytes | None) -> Registration:
    """The registration under `key`, or Rejected(reason): malformed, foreign (another
    cluster's record, or a key not in our layout), unsigned / bad_signature (with a secret)."""
    prefix = cluster_prefix(cluster) + b"engines/"
    if not key.startswith(prefix) or not key[len(prefix):].isalnum():
        raise Rejected("foreign", f"key {key[:200]!r} is not {prefix.decode()}<lease>")
    if len(value) > MAX_VALUE_BYTES:
        raise Rejected("malformed", f"{key.decode()}: value of {len(value)} bytes")
    try:
        body = json.loads(value)
    except (ValueError, RecursionError):
        raise Rejected("malformed", f"{key.decode()}: value is not JSON") from None
    if not isinstance(body, dict):
        raise Rejected("malformed", f"{key.decode()}: value is not a JSON object")
    if body.get("cluster") != cluster:
        raise Rejected("foreign", f"{key.decode()}: names cluster {body.get('cluster')!r}")
    if secret is not None:
        sig = body.get("sig")
        if not isinstance(sig, str):
            raise Rejected("unsigned", f"{key.decode()}: not signed with the cluster secret")
        if not hmac.compare_digest(sig.encode(), _mac(secret, key, body).encode()):
            raise Rejected("bad_signature", f"{key.decode()}: signature does not verify")
    reg = Registration(cluster, body.get("role"), body.get("url"), body.get("model"),
                       body.get("kv"))
    _check(key, reg)
    return reg


def _check(key: bytes, reg: Registration) -> None:
    where = key.decode()
    if reg.role not in ROUTED_ROLES:
        raise Rejected("malformed", f"{where}: role {reg.role!r} not in {ROUTED_ROLES}")
    if not isinstance(reg.model, str):
        raise Rejected("malformed", f"{where}: model is not a string")
    parts = urlsplit(reg.url) if isinstance(reg.url, str) else None
    if (parts is None or parts.scheme not in ("http", "https") or not parts.hostname
            or parts.query or parts.fragment or reg.url != reg.url.strip().rstrip("/")):
        raise Rejected("malformed", f"{where}: url {reg.url!r} is not http(s)://host:port")
    if reg.kv is not None:
        if not isinstance(reg.kv, dict):
            raise Rejected("malformed", f"{where}: kv is not an object")
        try:
            ends = reg.kv_endpoints()
        except (KeyError, TypeError, ValueError, AttributeError):
            raise Rejected("malformed", f"{where}: kv names no usable side channel") from None
        if not all(isinstance(h, str) and h and 0 < p < 65536 for h, p in ends):
            raise Rejected("malformed", f"{where}: kv names a bad side channel {ends}")
