"""`pdserve proxy` (= `python -m proxy`): the P/D proxy. Speaks HTTP only."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from cluster.args import SECRET_ENV, add_etcd_args
from proxy.config import (
    DISAGG_MIN_TOKENS,
    MODES,
    P_FAILURE_POLICIES,
    ROUTING_POLICIES,
    ProxyConfig,
)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", action="append", default=[], metavar="URL",
                        help="a prefill (P) server, e.g. http://10.0.0.1:8100 (repeatable)")
    parser.add_argument("--decode", action="append", default=[], metavar="URL",
                        help="a decode (D) server (repeatable)")
    add_etcd_args(parser)  # --discovery: the pools follow the engines registered in etcd
    parser.add_argument("--kv-secret", default=None,
                        help="with --discovery: route only to registrations signed with this "
                        "secret (the engines' KV secret; or PDSERVE_KV_SECRET)")
    parser.add_argument("--etcd-watch-idle", type=float, default=10.0, metavar="S",
                        help="with --discovery: a watch on etcd silent this long is created "
                        "again, so a frozen etcd or a half-open connection is noticed "
                        "(default: 10)")
    parser.add_argument("--retries", type=int, default=2,
                        help="a request whose P or D fails before the client got a byte is "
                        "sent to another pair, at most this many more times (default: 2)")
    parser.add_argument("--mode", choices=MODES, default="push",
                        help="push: both legs at once, P writes KV into D; "
                        "pull: P first, then D reads KV (default: push)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every route but "
                        "/health (/metrics too, unless --public-metrics) and send it to the "
                        "backends")
    parser.add_argument("--public-metrics", action="store_true",
                        help="serve /metrics without the API key (for a Prometheus scraper "
                        "that holds no key); off by default, since the counters reveal load "
                        "and traffic")
    parser.add_argument("--p-failure-policy", choices=P_FAILURE_POLICIES, default="recompute",
                        help="on a failed P leg: let D recompute the prompt, or cancel the "
                        "request with an error (default: recompute)")
    parser.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                        help="bound on one request, end to end (default: 600)")
    parser.add_argument("--health-interval", type=float, default=2.0, metavar="S",
                        help="period of the backend health poll (default: 2)")
    parser.add_argument("--health-timeout", type=float, default=2.0, metavar="S",
                        help="timeout of one health check or /kv_transfer/info (default: 2)")
    parser.add_argument("--max-request-bytes", type=int, default=8 * 1024 * 1024,
                        help="largest accepted request body (default: 8 MiB)")
    parser.add_argument("--log-level", default="info",
                        choices=("debug", "info", "warning", "error"))
    add_routing_args(parser)


def add_routing_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--routing", choices=ROUTING_POLICIES, default="kv-aware",
                        help="how P and D are chosen: kv-aware scores each by its cached "
                        "prefix against its load (default), least-outstanding, round-robin")
    parser.add_argument("--tokenizer", default=None, metavar="MODEL",
                        help="the served model (directory or .gguf): the proxy tokenizes "
                        "prompts once to match them against the caches (kv-aware); "
                        "without it kv-aware routes by load alone")
    parser.add_argument("--kv-events", action="append", default=[],
                        metavar="URL=tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT]",
                        help="a backend's KV event publisher (its --kv-events-config "
                        "endpoint, optional replay endpoint), one per data-parallel rank "
                        "(repeatable); backends without one are tracked by what was routed")
    parser.add_argument("--kv-events-topic", default="", help="topic of the KV events")
    parser.add_argument("--disagg-min-tokens", type=int, default=None, metavar="N",
                        help="kv-aware: a request whose uncached part on D is below N "
                        f"tokens runs on D alone (default {DISAGG_MIN_TOKENS}, measured by "
                        "pdserve bench multiturn; 0: always disaggregate; needs --tokenizer)")
    parser.add_argument("--prefill-max-outstanding", type=int, default=0, metavar="N",
                        help="kv-aware: a P with N legs in flight is saturated; when every "
                        "P is, requests run on D alone (default 0: never)")
    parser.add_argument("--decode-max-outstanding", type=int, default=0, metavar="N",
                        help="kv-aware: a D with N legs in flight has no room for a "
                        "request alone (default 0: no limit)")


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    return ProxyConfig(
        prefill_urls=tuple(args.prefill),
        decode_urls=tuple(args.decode),
        mode=args.mode,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        public_metrics=args.public_metrics,
        p_failure_policy=args.p_failure_policy,
        request_timeout=args.request_timeout,
        health_interval=args.health_interval,
        health_timeout=args.health_timeout,
        max_body_bytes=args.max_request_bytes,
        discovery=args.discovery,
        cluster=args.cluster,
        etcd_ca=args.etcd_ca,
        etcd_cert=args.etcd_cert,
        etcd_key=args.etcd_key,
        etcd_watch_idle=args.etcd_watch_idle,
        registration_secret=args.kv_secret or os.environ.get(SECRET_ENV) or None,
        retries=args.retries,
        routing=args.routing,
        tokenizer=args.tokenizer,
        kv_events=tuple(args.kv_events),
        kv_events_topic=args.kv_events_topic,
        disagg_min_tokens=(args.disagg_min_tokens if args.disagg_min_tokens is not None
                           else DISAGG_MIN_TOKENS if args.routing == "kv-aware" else 0),
        prefill_max_outstanding=args.prefill_max_outstanding,
        decode_max_outstanding=args.decode_max_outstanding,
    )


def main(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"pdserve proxy: error: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    from proxy.app import build_app
    from proxy.http_server import CoalescingHttpToolsProtocol

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per health check
    sock = _listen_socket(config.host, config.port)
    # uvloop and httptools (C event loop, C HTTP parser): the proxy is one more HTTP hop on
    # every request's TTFT, and asyncio+h11 cost about 2 ms more per request here
    uvicorn.run(build_app(config), fd=sock.fileno(), log_level=args.log_level,
                access_log=False, timeout_graceful_shutdown=5, loop="uvloop",
                http=CoalescingHttpToolsProtocol)
    return 0


def _listen_socket(host: str, port: int) -> socket.socket:
    """A bound socket with TCP_NODELAY, which accepted connections inherit: streamed
    chunks on a keep-alive connection must not wait for the client's delayed ACK."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def run(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve proxy", description=__doc__)
    add_args(parser)
    return main(parser.parse_args(argv))
