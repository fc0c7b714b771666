"""Start an engine server as a child process and wait until it answers /health.

Used by tests, the demo and scripts: `with launch_server(model_dir, "--seed", "1") as s:`
gives `s.url`, `s.pid`, `s.process`; leaving the block stops it (SIGTERM, then SIGKILL after
`stop_timeout`) and reaps every process it left behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import httpx
import psutil

from engine.net import free_port


class ServerProcess:
    def __init__(self, argv: list[str], host: str, port: int, env: dict[str, str] | None,
                 log_path: str | None) -> None:
        self.host, self.port = host, port
        self.url = f"http://{host}:{port}"
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115
        self.process = subprocess.Popen(argv, env=env, stdout=self._log,
                                        stderr=subprocess.STDOUT)
        self.pid = self.process.pid
        self.log_path = log_path

    def wait_healthy(self, timeout: float = 180.0) -> None:
        """Polls every 50 ms: a TCP connect (refused until the server listens, which it does
        once its engine is up) before each GET /health, so a fine poll costs the caller no
        CPU; a test suite pays the poll's mean latency once per server start."""
        deadline = time.monotonic() + timeout
        last = "nothing listens on the port"  # what the last poll saw, for the failure
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server on port {self.port} exited with "
                                   f"{self.process.returncode} during start-up{self._tail()}")
            if self._listening():
                try:
                    r = httpx.get(self.url + "/health", timeout=2.0)
                    if r.status_code == 200:
                        return
                    last = f"GET /health answered {r.status_code}: {r.text[:300]!r}"
                except httpx.HTTPError as exc:
                    last = f"GET /health failed: {type(exc).__name__}: {exc}"
            time.sleep(0.05)
        self.dump_stacks()
        self.stop()
        raise TimeoutError(f"server on port {self.port} not healthy after {timeout}s ({last}; "
                           f"listening there: {self._listeners()})"
                           f"{self._tail(16000)}")

    def _listeners(self) -> str:
        """The processes (pid and command) that listen on the server's port."""
        try:
            pids = {c.pid for c in psutil.net_connections("tcp")
                    if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == self.port}
            return ", ".join(f"{pid} {' '.join(psutil.Process(pid).cmdline())[:120]}"
                             for pid in sorted(p for p in pids if p)) or "none"
        except (psutil.Error, OSError) as exc:
            return f"unknown ({exc})"

    def _listening(self) -> bool:
        try:
            socket.create_connection((self.host, self.port), timeout=1.0).close()
        except OSError:
            return False
        return True

    def dump_stacks(self, settle: float = 1.0) -> None:
        """Every process of the server's tree writes its threads' Python stacks into the log
        (SIGUSR1, engine/stackdump.py): where a hung start-up stands."""
        procs = [self.pid, *(p.pid for p in self.descendants())]
        for pid in procs:
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(settle)  # faulthandler writes from the signal handler: no state to wait on

    def _tail(self, size: int = 4000) -> str:
        if not self.log_path:
            return ""
        with open(self.log_path, "rb") as f:
            return "\n" + f.read()[-size:].decode(errors="replace")

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, wait, then SIGKILL the server and anything it left behind."""
        leftovers = self.descendants()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        _, alive = psutil.wait_procs(leftovers, timeout=5)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        if self._log is not subprocess.DEVNULL:
            self._log.close()
        return self.process.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def launch_server(
    model: str,
    *args: str,
    host: str = "127.0.0.1",
    port: int | None = None,
    module: str = "engine.server",
    env: dict[str, str] | None = None,
    log_path: str | None = None,
    ready_timeout: float = 180.0,
    extra_argv: Sequence[str] = (),
    wait: bool = True,
) -> ServerProcess:
    """`python -m <module> MODEL --host H --port P *args`; healthy on return unless
    `wait=False` (then call `wait_healthy()`; lets several servers start side by side)."""
    port = port or free_port(host)
    argv = [sys.executable, "-m", module, model, "--host", host, "--port", str(port), *args,
            *extra_argv]
    full_env = {**os.environ, **(env or {})}
    server = ServerProcess(argv, host, port, full_env, log_path)
    if not wait:
        return server
    try:
        server.wait_healthy(ready_timeout)
    except BaseException:
        server.stop()
        raise
    return server
