"""free_port across processes: a port one live process was handed is never handed to
another (two xdist workers once chose the same --kv-port and one server failed to bind it),
and a dead process's claims are free again."""

from __future__ import annotations

import json
import subprocess
import sys

from engine import net

CHILD = """
import sys
from engine.net import free_port
ports = [free_port() for _ in range(int(sys.argv[1]))]
print(" ".join(map(str, ports)), flush=True)
sys.stdin.read()  # hold the claims until the parent is done
"""


def test_a_live_processs_ports_are_not_handed_out_again_and_a_dead_ones_are_freed():
    lo, _ = net._ephemeral_range()
    n = (lo - 20000) // 20  # a twentieth of the range: 500 blind picks would hit ~25
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(n)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        theirs = {int(p) for p in child.stdout.readline().split()}
        assert len(theirs) == n
        mine = {net.free_port() for _ in range(500)}
        assert not mine & theirs
        with open(net.CLAIMS) as f:
            table = json.load(f)
        assert {int(p) for p, pid in table.items() if pid == child.pid} == theirs
    finally:
        child.stdin.close()
        child.wait(30)
    with net._claims() as claimed:
        assert not claimed & theirs  # the child is gone: its claims are dropped
    with open(net.CLAIMS) as f:
        assert not {int(p) for p in json.load(f)} & theirs
