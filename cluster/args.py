"""Command-line flags of etcd membership, shared by the engine roles and the proxy."""

from __future__ import annotations

import argparse
import os

from cluster.etcd import EtcdTarget

SECRET_ENV = "PDSERVE_KV_SECRET"  # the KV secret also signs registrations (docs/security.md)


def add_etcd_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--discovery", default=None, metavar="etcd://HOST:PORT",
                        help="cluster membership in etcd (etcds:// for TLS; "
                        "user:password@ or $PDSERVE_ETCD_PASSWORD for etcd's authentication)")
    parser.add_argument("--cluster", default="default",
                        help="cluster name: the etcd prefix /pdserve/NAME/ (default: default)")
    parser.add_argument("--etcd-ca", default=None, metavar="FILE",
                        help="CA bundle that verifies etcd's TLS certificate (etcds://)")
    parser.add_argument("--etcd-cert", default=None, metavar="FILE",
                        help="client certificate for etcd's TLS client authentication")
    parser.add_argument("--etcd-key", default=None, metavar="FILE",
                        help="key of --etcd-cert")


def etcd_target(args: argparse.Namespace) -> EtcdTarget | None:
    """The etcd of --discovery (None without it); a ValueError names a bad flag."""
    if not args.discovery:
        return None
    if not args.cluster or not args.cluster.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"--cluster must be letters, digits, '-' or '_', got {args.cluster!r}")
    return EtcdTarget.parse(args.discovery, ca=args.etcd_ca, cert=args.etcd_cert,
                            key=args.etcd_key)


def signing_secret(flag: str | None) -> bytes | None:
    raw = flag or os.environ.get(SECRET_ENV) or None
    return raw.encode() if raw else None
