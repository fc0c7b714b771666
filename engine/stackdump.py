"""SIGUSR1 writes every thread's Python stack to stderr (the server's log): how a hung start-up
or step is seen without a debugger (`kill -USR1 PID`). The server, its EngineCore processes and
their tensor-parallel workers install it; the test launcher signals a server's whole process
tree before it gives up waiting for /health, so the failure shows where each process stood."""

from __future__ import annotations

import faulthandler
import signal
import sys


def install() -> None:
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
