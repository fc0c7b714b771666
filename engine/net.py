"""Choosing free TCP ports: what the prefill/decode role launcher (prefill/role.py) and the
process launcher (pdserve/launcher.py) use to pick the ports their servers will bind."""

from __future__ import annotations

import random
import socket

_handed_out: set[int] = set()  # ports free_port chose in this process (maybe not bound yet)


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1", count: int = 1) -> int:
    """A free TCP port; with `count` > 1 the first of `count` consecutive free ones (a TP
    engine's ranks serve their side channels at kv_port + rank).

    Chosen below the kernel's ephemeral range (from 20000 up to it), never one this process
    chose before: a port in that range is also what the kernel hands out for every outgoing
    connection and every bind to port 0 (a health poll, a ZeroMQ or UCX socket, gloo), so a
    port chosen there could be taken in the moment before its server binds it."""
    lo, _ = _ephemeral_range()
    first, last = 20000, lo - count
    rng = random.Random()
    for _ in range(200):
        base = rng.randint(first, last) if last > first else _kernel_port(host)
        ports = range(base, base + count)
        if _handed_out.isdisjoint(ports) and all(_bindable(host, p) for p in ports):
            _handed_out.update(ports)
            return base
    raise RuntimeError(f"no {count} consecutive free ports on {host}")


def _kernel_port(host: str) -> int:
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _bindable(host: str, port: int) -> bool:
    if port > 65535:
        return False
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
