"""Choosing free TCP ports: what the process launcher (pdserve/launcher.py), the demo, the
benchmarks and the tests use to pick the ports their servers will bind.

A port is free when it can be bound now and no live process on this machine was handed it
by free_port before: the claims sit in a table shared by every process of this user
(`pdserve-ports-<uid>.json` in the temp dir, under an flock), so two launchers running side
by side (pytest-xdist workers, a benchmark beside a test run) never pick the same port in
the seconds before its server binds it. A claim lasts as long as the process that made it."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import socket
import tempfile
from collections.abc import Iterator

import psutil

_handed_out: set[int] = set()  # ports free_port chose in this process (maybe not bound yet)
CLAIMS = os.path.join(tempfile.gettempdir(), f"pdserve-ports-{os.getuid()}.json")


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

    Chosen below the kernel's ephemeral range (from 20000 up to it), never one a live process
    chose before (the claims table): a port in that range is also what the kernel hands out
    for every outgoing connection and every bind to port 0 (a health poll, a ZeroMQ or UCX
    socket, gloo), so a port chosen there could be taken in the moment before its server
    binds it."""
    lo, _ = _ephemeral_range()
    first, last = 20000, lo - count
    rng = random.Random()
    with _claims() as claimed:
        for _ in range(200):
            base = rng.randint(first, last) if last > first else _kernel_port(host)
            ports = range(base, base + count)
            if (_handed_out.isdisjoint(ports) and claimed.isdisjoint(ports)
                    and all(_bindable(host, p) for p in ports)):
                _handed_out.update(ports)
                return base
    raise RuntimeError(f"no {count} consecutive free ports on {host}")


@contextlib.contextmanager
def _claims() -> Iterator[set[int]]:
    """The ports live processes claimed, under the table's lock; on leaving, this process's
    claims (`_handed_out`) are written back with the dead processes' dropped. Without a
    writable temp dir the claims are this process's alone."""
    try:
        f = open(CLAIMS, "a+")  # noqa: SIM115 - held open for the lock's whole span
    except OSError:
        yield set()
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        try:
            table = {int(p): int(pid) for p, pid in json.loads(f.read() or "{}").items()}
        except (ValueError, AttributeError):
            table = {}  # a torn or foreign file: start the table again
        me = os.getpid()
        live = {p: pid for p, pid in table.items() if pid != me and psutil.pid_exists(pid)}
        yield set(live)
        live.update((p, me) for p in _handed_out)
        f.seek(0)
        f.truncate()
        json.dump(live, f)


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
