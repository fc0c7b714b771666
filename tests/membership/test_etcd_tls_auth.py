"""etcd's own TLS and authentication, as docs/security.md tells an operator to run it (issue 30):
a real etcd serving only https with a certificate from a CA made here (the `cryptography`
package), authentication enabled through its JSON gateway (what `etcdctl user add` / `auth
enable` do), a P and a D registering through it and a proxy routing from it alone. A wrong
password and a client without the CA are refused, each with an error naming why; a proxy
with the wrong password routes nothing (503) and says etcd is down.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from etcd_harness import EtcdProcess  # noqa: E402
from pd_harness import TEST_ENV, metric, role_args, start_proxy, wait_until  # noqa: E402
from pki_kit import make_pki  # noqa: E402

from cluster.etcd import EtcdClient, EtcdError, EtcdTarget  # noqa: E402
from engine.net import free_port  # noqa: E402
from pdserve.launcher import ServerProcess, launch_server  # noqa: E402

CLUSTER = "tls"
PASSWORD = "etcd-root-pw-4242"
SECRET = "etcd-tls-test-secret-0123456789"


def _ca(pki: dict[str, str]) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=pki["ca"])


class TLSEtcd(EtcdProcess):
    """etcd serving clients over https only (the harness's process, TLS flags added)."""

    def __init__(self, pki: dict[str, str]) -> None:
        self.pki = pki
        super().__init__()

    def start(self) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        https = f"https://127.0.0.1:{self.client_port}"
        self.url = f"etcds://127.0.0.1:{self.client_port}"
        self.process = subprocess.Popen(
            [self.binary, "--name", "t", "--data-dir", self.data_dir,
             "--listen-client-urls", https, "--advertise-client-urls", https,
             "--cert-file", self.pki["cert"], "--key-file", self.pki["key"],
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"t={peer}", "--log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(https + "/health", timeout=1, verify=_ca(self.pki)).is_success:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError("etcd (TLS) did not become healthy in 30 s")


def enable_auth(etcd: TLSEtcd) -> None:
    """root with PASSWORD, then authentication on (etcdctl's user add / auth enable)."""
    base = f"https://127.0.0.1:{etcd.client_port}"
    with httpx.Client(base_url=base, verify=_ca(etcd.pki), timeout=5) as c:
        for path, body in (("/v3/auth/user/add", {"name": "root", "password": PASSWORD}),
                           ("/v3/auth/role/add", {"name": "root"}),
                           ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
                           ("/v3/auth/enable", {})):
            r = c.post(path, json=body)
            assert r.status_code == 200 or "already exists" in r.text, (path, r.text)
        # from here on an anonymous client is refused
        r = c.post("/v3/kv/range", json={"key": "Lw=="})
        assert r.status_code != 200, r.text


def _try(target: EtcdTarget) -> str:
    async def go() -> str:
        client = EtcdClient(target)
        try:
            await client.get_prefix(b"/pdserve/")
            return ""
        except EtcdError as exc:
            return str(exc)
        finally:
            await client.aclose()

    return asyncio.run(go())


@pytest.fixture(scope="module")
def tls_cluster(tiny_model: str) -> Iterator[tuple[TLSEtcd, list[ServerProcess]]]:
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server; make test does)")
    pki = make_pki(tempfile.mkdtemp(prefix="pdserve-pki-"))
    etcd = TLSEtcd(pki)
    procs: list[ServerProcess] = []
    try:
        enable_auth(etcd)
        url = f"etcds://root@127.0.0.1:{etcd.client_port}"
        env = {**TEST_ENV, "PDSERVE_ETCD_PASSWORD": PASSWORD}
        for name in ("P0", "D0"):
            module = "prefill" if name.startswith("P") else "decode"
            procs.append(launch_server(
                tiny_model, *role_args(64, None, "NixlPushConnector", name, free_port(count=2)),
                "--discovery", url, "--etcd-ca", pki["ca"], "--cluster", CLUSTER,
                "--discovery-ttl", "10", "--kv-secret", SECRET,
                module=module, env=env, wait=False))
        for s in procs:
            s.wait_healthy(180)
        yield etcd, procs
    finally:
        for s in procs:
            s.stop(10)
        etcd.stop()


def _proxy_args(etcd: TLSEtcd) -> tuple[str, ...]:
    return ("--discovery", f"etcds://root@127.0.0.1:{etcd.client_port}",
            "--etcd-ca", etcd.pki["ca"], "--cluster", CLUSTER, "--kv-secret", SECRET)


def _proxy(etcd: TLSEtcd, password: str) -> ServerProcess:
    os.environ["PDSERVE_ETCD_PASSWORD"] = password  # start_proxy passes os.environ on
    try:
        return start_proxy([], [], "push", *_proxy_args(etcd))
    finally:
        del os.environ["PDSERVE_ETCD_PASSWORD"]


def _refused_proxy(etcd: TLSEtcd, password: str) -> ServerProcess:
    """A proxy that cannot read etcd: up (its /metrics answers), not healthy (no backend)."""
    port = free_port()
    argv = [sys.executable, "-m", "proxy", "--host", "127.0.0.1", "--port", str(port),
            "--mode", "push", "--log-level", "warning", *_proxy_args(etcd)]
    log = os.path.join(tempfile.mkdtemp(prefix="pdserve-proxy-"), "proxy.log")
    proxy = ServerProcess(argv, "127.0.0.1", port,
                          {**os.environ, **TEST_ENV, "PDSERVE_ETCD_PASSWORD": password}, log)

    def up() -> bool:
        try:
            return httpx.get(proxy.url + "/metrics", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, 60, "the proxy's /metrics")
    return proxy


def test_engines_and_proxy_work_through_etcd_tls_and_auth(tls_cluster) -> None:
    etcd, engines = tls_cluster
    proxy = _proxy(etcd, PASSWORD)
    try:
        wait_until(lambda: metric(proxy, "pdserve:proxy_discovery_etcd_up") == 1, 10,
                   "the proxy's watch through TLS and auth")
        urls = {s.url for s in engines}

        def pools() -> set[str]:
            h = httpx.get(proxy.url + "/health", timeout=5).json()
            return {b["url"] for role in ("prefill", "decode") for b in h.get(role, [])
                    if b["healthy"]}

        wait_until(lambda: pools() == urls, 15, "P0 and D0 in the proxy's pools")
        r = httpx.post(proxy.url + "/v1/completions", timeout=60,
                       json={"model": "m", "prompt": [5, 6, 7, 8], "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert metric(engines[0], "pdserve:kv_push_writes_total") >= 1  # a real P/D pair
    finally:
        proxy.stop(10)


def test_wrong_password_and_missing_ca_are_refused_by_name(tls_cluster) -> None:
    etcd, _ = tls_cluster
    hostport = f"127.0.0.1:{etcd.client_port}"
    ca = etcd.pki["ca"]
    ok = _try(EtcdTarget.parse(f"etcds://root:{PASSWORD}@{hostport}", ca=ca))
    assert ok == ""
    wrong = _try(EtcdTarget.parse(f"etcds://root:not-it@{hostport}", ca=ca))
    assert "authenticate" in wrong and "authentication failed" in wrong, wrong
    anonymous = _try(EtcdTarget.parse(f"etcds://{hostport}", ca=ca))
    assert "user name is empty" in anonymous, anonymous  # etcd: auth on, no credentials
    no_ca = _try(EtcdTarget.parse(f"etcds://root:{PASSWORD}@{hostport}"))
    assert "CERTIFICATE_VERIFY_FAILED" in no_ca, no_ca
    plain = _try(EtcdTarget.parse(f"etcd://root:{PASSWORD}@{hostport}"))
    assert plain, "plain HTTP to a TLS-only etcd must fail"
    # a proxy with the wrong password routes nothing and says etcd is down
    proxy = _refused_proxy(etcd, "not-it")
    try:
        assert metric(proxy, "pdserve:proxy_discovery_etcd_up") == 0
        r = httpx.post(proxy.url + "/v1/completions", timeout=30,
                       json={"model": "m", "prompt": [5, 6, 7], "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert proxy.log_path is not None

        def logged() -> str:
            with open(proxy.log_path, errors="replace") as f:
                return f.read()

        wait_until(lambda: "authentication failed" in logged(), 10, "the proxy's log line")
        assert logged().count("authentication failed") == 1, "logged once, not per retry"
    finally:
        proxy.stop(10)
