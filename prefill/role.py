"""The launcher both roles share: `serve` plus the role's connector config.

It lives with the roles, not in `kvconnector` (it imports the server CLI, which the KV
transfer layer must not); `decode.cli` imports it from here.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import uuid

from cluster.args import add_etcd_args, etcd_target, signing_secret
from cluster.registrar import Registrar
from engine.net import free_port


def add_role_args(parser: argparse.ArgumentParser, role: str) -> None:
    from engine.server.cli import add_serve_args

    add_serve_args(parser)
    parser.add_argument("--kv-host", default="127.0.0.1",
                        help="address the KV side channel binds and advertises")
    parser.add_argument("--kv-port", type=int, default=0,
                        help="side-channel port (0: pick a free one at start)")
    parser.add_argument("--kv-connector", default="NixlPushConnector",
                        choices=["NixlPushConnector", "NixlConnector"],
                        help="push (P writes into D) or pull (D reads from P)")
    parser.add_argument("--engine-id", default=None, help="this engine's id (default: random)")
    parser.add_argument("--kv-extra-config", default=None,
                        help="JSON merged into kv_connector_extra_config")
    add_etcd_args(parser)
    parser.add_argument("--advertise-host", default=None,
                        help="host in the URL registered with --discovery (default: --host, "
                        "or this machine's name when --host is a wildcard)")
    parser.add_argument("--discovery-ttl", type=int, default=5, metavar="S",
                        help="lease TTL of the etcd registration: a killed engine leaves "
                        "the proxies' pools within it (default: 5)")
    parser.set_defaults(_role=role)


def role_kv_config(args: argparse.Namespace, role: str) -> str:
    """The kv-transfer config JSON for this role; explicit --kv-transfer-config wins."""
    base = json.loads(args.kv_transfer_config) if args.kv_transfer_config else {}
    extra = dict(base.get("kv_connector_extra_config", {}))
    if args.kv_extra_config:
        extra.update(json.loads(args.kv_extra_config))
    # every rank's side channel: data-parallel rank d's tensor-parallel rank t at
    # kv_port + d * tp + t (an external-LB server runs one DP rank)
    tp = getattr(args, "tensor_parallel_size", None) or 1
    dp = 1 if getattr(args, "data_parallel_external_lb", None) else (
        getattr(args, "data_parallel_size", None) or 1)
    port = base.get("kv_port") or args.kv_port or free_port(args.kv_host, count=tp * dp)
    config = {
        "kv_connector": base.get("kv_connector", args.kv_connector),
        "kv_role": base.get("kv_role", "kv_producer" if role == "prefill" else "kv_consumer"),
        "engine_id": base.get("engine_id") or args.engine_id or f"{role}-{uuid.uuid4().hex[:8]}",
        "kv_host": base.get("kv_host", args.kv_host),
        "kv_port": port,
        "kv_connector_extra_config": extra,
    }
    return json.dumps(config)


def registrar(args: argparse.Namespace, role: str) -> Registrar | None:
    """The etcd registration of this server (None without --discovery)."""
    target = etcd_target(args)
    if target is None:
        return None
    wildcard = args.host in ("", "0.0.0.0", "::")
    host = args.advertise_host or (socket.getfqdn() if wildcard else args.host)
    host = f"[{host}]" if ":" in host else host
    local = "127.0.0.1" if wildcard else args.host
    local = f"[{local}]" if ":" in local else local
    return Registrar(target, cluster=args.cluster, role=role, url=f"http://{host}:{args.port}",
                     model=(args.served_model_name or [args.model])[0],
                     local_url=f"http://{local}:{args.port}", api_key=args.api_key,
                     secret=signing_secret(args.kv_secret), ttl=args.discovery_ttl)


def run_role(args: argparse.Namespace, role: str) -> int:
    from engine.server.cli import serve_main

    args.kv_transfer_config = role_kv_config(args, role)
    try:
        companion = registrar(args, role)
    except ValueError as exc:
        print(f"pdserve {role}: error: {exc}", file=sys.stderr)
        return 2
    return serve_main(args, companions=[companion] if companion else []) or 0
