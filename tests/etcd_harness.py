"""A real etcd process for membership tests: free ports, a temp data dir, kill and restart.

`make test` installs Debian's etcd-server when `etcd` is missing; a machine without it skips
these tests with that hint.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import tempfile
import time

import httpx
import psutil
import pytest

from engine.net import free_port


class EtcdProcess:
    def __init__(self) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            pytest.skip("etcd is not installed (apt-get install etcd-server; make test does)")
        self.binary = binary
        self.data_dir = tempfile.mkdtemp(prefix="pdserve-etcd-")
        self.client_port = free_port()
        self.peer_port = free_port()
        self.url = f"etcd://127.0.0.1:{self.client_port}"
        self.http = f"http://127.0.0.1:{self.client_port}"
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.process = subprocess.Popen(
            [self.binary, "--name", "t", "--data-dir", self.data_dir,
             "--listen-client-urls", self.http, "--advertise-client-urls", self.http,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"t={peer}", "--log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.http + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError("etcd did not become healthy in 30 s")

    def freeze(self) -> None:
        """SIGSTOP: etcd's sockets stay open (the kernel still accepts connections) but
        nothing answers - a hung host or a half-open path, as a client sees it."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not all(_stopped(tid) for tid in self._threads()):  # every thread of it
            if time.monotonic() > deadline:
                raise TimeoutError("etcd did not stop within 10 s of SIGSTOP")
            time.sleep(0.005)

    def _threads(self) -> list[int]:
        assert self.process is not None
        return [t.id for t in psutil.Process(self.process.pid).threads()]

    def thaw(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.thaw()
            self.kill()
        shutil.rmtree(self.data_dir, ignore_errors=True)


def _stopped(tid: int) -> bool:
    try:
        return psutil.Process(tid).status() == psutil.STATUS_STOPPED
    except psutil.NoSuchProcess:
        return True  # a thread that ended cannot answer either


def etcd_put(etcd: EtcdProcess, key: bytes, value: bytes) -> None:
    """Write a raw record, as a rogue or broken writer would."""
    from cluster.etcd import EtcdClient, EtcdTarget

    async def put() -> None:
        client = EtcdClient(EtcdTarget.parse(etcd.url))
        try:
            await client.put(key, value)
        finally:
            await client.aclose()

    asyncio.run(put())


def etcd_keys(etcd: EtcdProcess, prefix: bytes) -> dict[bytes, bytes]:
    from cluster.etcd import EtcdClient, EtcdTarget

    async def get() -> dict[bytes, bytes]:
        client = EtcdClient(EtcdTarget.parse(etcd.url))
        try:
            return dict((await client.get_prefix(prefix))[1])
        finally:
            await client.aclose()

    return asyncio.run(get())


def etcd_delete(etcd: EtcdProcess, key: bytes) -> None:
    from cluster.etcd import EtcdClient, EtcdTarget

    async def delete() -> None:
        client = EtcdClient(EtcdTarget.parse(etcd.url))
        try:
            await client.delete(key)
        finally:
            await client.aclose()

    asyncio.run(delete())
