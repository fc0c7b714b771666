"""2P2D and two proxies from etcd alone (issue 30): real etcd, real engines, real NIXL.

One cluster for the module (tests run in file order and build on each other): etcd, P0, P1,
D0, D1 registered with --discovery under a 2 s lease and signed with the KV secret, and two
proxies watching. Measurements are printed (pytest -s) and asserted against bounds.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from etcd_harness import EtcdProcess, etcd_delete, etcd_keys, etcd_put  # noqa: E402
from pd_harness import TEST_ENV, metric, role_args, wait_until  # noqa: E402

from cluster.registration import Registration, cluster_prefix, engine_key  # noqa: E402
from engine.net import free_port  # noqa: E402
from pdserve.launcher import ServerProcess, launch_server  # noqa: E402

CLUSTER = "t"
TTL = 2
IDLE = 1  # the proxies' --etcd-watch-idle; the call timeout is their --health-timeout, 2 s
SECRET = "etcd-test-secret-0123456789"
PREFIX = cluster_prefix(CLUSTER)


class Cluster:
    def __init__(self, model: str, etcd: EtcdProcess) -> None:
        self.model, self.etcd = model, etcd
        self.engines: dict[str, ServerProcess] = {}
        self.proxies: list[ServerProcess] = []

    def start_engine(self, name: str, wait: bool = True) -> ServerProcess:
        module = "prefill" if name.startswith("P") else "decode"
        s = launch_server(self.model, *role_args(128, None, "NixlPushConnector", name,
                                                 free_port(count=2)),
                          "--discovery", self.etcd.url, "--cluster", CLUSTER,
                          "--discovery-ttl", str(TTL), "--kv-secret", SECRET,
                          module=module, env=TEST_ENV, wait=False)
        self.engines[name] = s
        if wait:
            s.wait_healthy(180)
        return s


def start_logged_proxy(log_path: str, *args: str) -> ServerProcess:
    """pd_harness.start_proxy's proxy, with its log kept (what it logs is asserted)."""
    port = free_port()
    proxy = ServerProcess([sys.executable, "-m", "proxy", "--host", "127.0.0.1", "--port",
                           str(port), "--mode", "push", "--health-interval", "0.5",
                           "--log-level", "warning", *args],
                          "127.0.0.1", port, {**os.environ, **TEST_ENV}, log_path)
    proxy.wait_healthy(60)
    return proxy


def log_lines(proxy: ServerProcess, text: str) -> int:
    assert proxy.log_path is not None
    with open(proxy.log_path, errors="replace") as f:
        return sum(text in line for line in f)


def pools(proxy: ServerProcess) -> dict[str, dict[str, bool]]:
    """{role: {url: healthy}} as the proxy reports it."""
    h = httpx.get(proxy.url + "/health", timeout=5).json()
    return {role: {b["url"]: b["healthy"] for b in h.get(role, [])}
            for role in ("prefill", "decode")}


def healthy(proxy: ServerProcess, role: str) -> set[str]:
    return {u for u, ok in pools(proxy)[role].items() if ok}


_prompt_seed = itertools.count(1)


def complete(proxy: ServerProcess, seed: int | None = None) -> httpx.Response:
    seed = next(_prompt_seed) if seed is None else seed
    prompt = [(seed * 7919 + i * 31) % 1900 + 4 for i in range(12)]
    return httpx.post(proxy.url + "/v1/completions", timeout=60,
                      json={"model": "m", "prompt": prompt, "max_tokens": 4,
                            "temperature": 0})


def kill9(server: ServerProcess) -> None:
    procs = [psutil.Process(server.pid), *server.descendants()]
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)


class Load:
    """Requests through both proxies, back to back, until stopped; every failure is kept."""

    def __init__(self, proxies: list[ServerProcess]) -> None:
        self.proxies = proxies
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(p,), daemon=True)
                         for p in proxies]

    def _run(self, proxy: ServerProcess) -> None:
        while not self._stop.is_set():
            try:
                r = complete(proxy)
                if r.status_code == 200:
                    self.ok += 1
                else:
                    self.failures.append(f"{proxy.url}: {r.status_code} {r.text[:300]}")
            except httpx.HTTPError as exc:
                self.failures.append(f"{proxy.url}: {type(exc).__name__}: {exc}")

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


@pytest.fixture(scope="module")
def cluster(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    etcd = EtcdProcess()
    c = Cluster(tiny_model, etcd)
    try:
        for name in ("P0", "P1", "D0", "D1"):
            c.start_engine(name, wait=False)
        for s in c.engines.values():
            s.wait_healthy(180)
        args = ("--discovery", etcd.url, "--cluster", CLUSTER, "--kv-secret", SECRET,
                "--etcd-watch-idle", str(IDLE))
        logs = tmp_path_factory.mktemp("proxies")
        c.proxies = [start_logged_proxy(str(logs / f"proxy{i}.log"), *args) for i in range(2)]
        yield c
    finally:
        for s in [*c.proxies, *c.engines.values()]:
            s.stop(10)
        etcd.stop()


def test_two_proxies_answer_from_etcd_alone(cluster: Cluster) -> None:
    urls = {role: {s.url for n, s in cluster.engines.items() if n[0] == role[0].upper()}
            for role in ("prefill", "decode")}
    for proxy in cluster.proxies:
        wait_until(lambda p=proxy: all(healthy(p, r) == urls[r] for r in urls), 10,
                   f"{proxy.url} to route over the four registered engines")
    answers = [complete(p, seed=1) for p in cluster.proxies]
    assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
    texts = {r.json()["choices"][0]["text"] for r in answers}
    assert len(texts) == 1, texts  # stateless proxies: the same greedy answer from either


def test_bad_registrations_are_counted_and_ignored(cluster: Cluster) -> None:
    before = {p.url: pools(p) for p in cluster.proxies}
    rogue = {"cluster": CLUSTER, "role": "decode", "url": "http://127.0.0.1:9",
             "model": "m", "kv": None}
    key = PREFIX + b"engines/"
    closed = free_port()
    unreachable = Registration(CLUSTER, "decode", f"http://127.0.0.1:{free_port()}", "m",
                               {"kv_host": "127.0.0.1", "kv_port": closed})
    writes = {
        "malformed": (key + b"b1", b"{not json"),
        "foreign": (key + b"b2", json.dumps({**rogue, "cluster": "other"}).encode()),
        "unsigned": (key + b"b3", json.dumps(rogue).encode()),
        "bad_signature": (key + b"b4", json.dumps({**rogue, "sig": "00" * 32}).encode()),
        "unreachable_side_channel": (key + b"b5", unreachable.encode(key + b"b5",
                                                                      SECRET.encode())),
    }
    etcd_put(cluster.etcd, PREFIX + b"junk", b"x")  # outside the layout: foreign too
    for k, v in writes.values():
        etcd_put(cluster.etcd, k, v)
    name = "pdserve:proxy_discovery_rejected_total"
    for proxy in cluster.proxies:
        for reason in writes:
            wait_until(lambda p=proxy, r=reason: _labelled(p, name, r) >= 1, 10,
                       f"{proxy.url} to count a {reason} registration")
        assert _labelled(proxy, name, "foreign") >= 2
        assert pools(proxy) == before[proxy.url]  # the rogue URLs never joined a pool
        assert complete(proxy).status_code == 200


def _labelled(proxy: ServerProcess, name: str, reason: str) -> float:
    text = httpx.get(proxy.url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and f'reason="{reason}"' in line)


def _routed_to(proxy: ServerProcess, url: str) -> float:
    """Requests the proxy sent to decode backend `url` (and that D answered: pairs count)."""
    text = httpx.get(proxy.url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve:proxy_route_pairs_total{")
               and f'decode="{url}"' in line)


def test_new_decode_takes_requests_without_restart(cluster: Cluster) -> None:
    d2 = cluster.start_engine("D2")
    t0 = time.monotonic()
    wait_until(lambda: any(d2.url.encode() in v for v in etcd_keys(cluster.etcd,
                                                                    PREFIX).values()),
               10, "D2's registration in etcd")
    t_registered = time.monotonic()
    for proxy in cluster.proxies:
        wait_until(lambda p=proxy: d2.url in healthy(p, "decode"), 5,
                   f"{proxy.url} to put D2 in rotation")
    t_rotation = time.monotonic()
    for i in itertools.count():
        assert i < 30, "D2 never took a request"
        assert complete(cluster.proxies[i % 2]).status_code == 200
        if sum(_routed_to(p, d2.url) for p in cluster.proxies) > 0:
            break
    t_first = time.monotonic()
    print(f"\nnew D: registered->in rotation of both proxies {t_rotation - t_registered:.3f} s,"
          f" registered->first request done {t_first - t_registered:.3f} s"
          f" (healthy->registered seen {t_registered - t0:.3f} s)")
    assert t_rotation - t_registered < 1.5


def test_sigkill_p_and_d_leave_both_pools_within_ttl_without_failed_requests(
        cluster: Cluster) -> None:
    p1, d1 = cluster.engines["P1"], cluster.engines["D1"]
    with Load(cluster.proxies) as load:
        wait_until(lambda: load.ok >= 4, 60, "load running")
        killed = time.monotonic()
        kill9(p1)
        kill9(d1)
        out, gone = {}, {}
        while len(gone) < 2 and time.monotonic() - killed < TTL + 5:
            for p in cluster.proxies:
                seen = pools(p)
                if p.url not in out and not (seen["prefill"].get(p1.url) or
                                             seen["decode"].get(d1.url)):
                    out[p.url] = time.monotonic() - killed
                if p.url not in gone and p1.url not in seen["prefill"] and \
                        d1.url not in seen["decode"]:
                    gone[p.url] = time.monotonic() - killed
            time.sleep(0.02)
        ok_at_kill = load.ok
        wait_until(lambda: load.ok >= ok_at_kill + 4, 60, "load going on after the kill")
    print(f"\nSIGKILL P1+D1: out of rotation after {sorted(out.values())} s, "
          f"gone from the pools after {sorted(gone.values())} s (TTL {TTL} s)")
    assert load.failures == []
    assert len(gone) == 2 and max(gone.values()) < TTL + 1.5, gone
    del cluster.engines["P1"], cluster.engines["D1"]


def test_etcd_killed_and_restarted_under_load_fails_no_request(cluster: Cluster) -> None:
    up = "pdserve:proxy_discovery_etcd_up"
    live = {n: s.url for n, s in cluster.engines.items()}
    with Load(cluster.proxies) as load:
        wait_until(lambda: load.ok >= 4, 60, "load running")
        cluster.etcd.kill()
        for proxy in cluster.proxies:
            wait_until(lambda p=proxy: metric(p, up) == 0, 10, f"{proxy.url} to see etcd gone")
        ok_down = load.ok
        wait_until(lambda: load.ok >= ok_down + 6, 60, "requests served while etcd is down")
        cluster.etcd.start()
        for proxy in cluster.proxies:
            wait_until(lambda p=proxy: metric(p, up) == 1, 15, f"{proxy.url} to watch again")
        ok_up = load.ok
        wait_until(lambda: load.ok >= ok_up + 4, 60, "requests served after etcd returned")
    assert load.failures == []
    # membership converges: exactly the live engines are registered and routed to
    wait_until(lambda: sorted(json.loads(v)["url"] for k, v in etcd_keys(
        cluster.etcd, PREFIX + b"engines/").items() if not k.endswith((b"b1", b"b2", b"b3",
                                                                       b"b4", b"b5")))
               == sorted(live.values()), 2 * TTL + 5, "etcd to hold the live engines")
    for proxy in cluster.proxies:
        seen = pools(proxy)
        assert set(seen["prefill"]) | set(seen["decode"]) == set(live.values()), seen


def test_frozen_etcd_is_noticed_logged_once_and_watched_again(cluster: Cluster) -> None:
    """SIGSTOP etcd under the proxies' watches: the kernel keeps the connections open and
    nothing arrives, as with a hung host or a half-open path. Each proxy notices within
    --etcd-watch-idle + its call timeout (etcd_up 0, one log line), routes over the last
    membership meanwhile, and after SIGCONT watches again and sees a new registration."""
    up = "pdserve:proxy_discovery_etcd_up"
    live = {s.url for s in cluster.engines.values()}
    for proxy in cluster.proxies:
        wait_until(lambda p=proxy: metric(p, up) == 1, 15, f"{proxy.url} to watch")
    lost = [log_lines(p, "unreachable (") for p in cluster.proxies]
    back = [log_lines(p, "answers again") for p in cluster.proxies]
    cluster.etcd.freeze()
    try:
        frozen = time.monotonic()
        for proxy in cluster.proxies:
            wait_until(lambda p=proxy: metric(p, up) == 0, IDLE + 2 + 5,
                       f"{proxy.url} to notice that etcd stopped answering")
        noticed = time.monotonic() - frozen
        for proxy in cluster.proxies:
            for _ in range(3):  # several re-watch attempts fail meanwhile: logged once
                assert complete(proxy).status_code == 200
            assert set(pools(proxy)["prefill"]) | set(pools(proxy)["decode"]) == live
    finally:
        cluster.etcd.thaw()
    for proxy in cluster.proxies:
        wait_until(lambda p=proxy: metric(p, up) == 1, 15, f"{proxy.url} to watch again")
    key = engine_key(CLUSTER, 0xA1F7E5)  # a lease id no engine holds
    new = Registration(CLUSTER, "decode", f"http://127.0.0.1:{free_port()}", "m", None)
    etcd_put(cluster.etcd, key, new.encode(key, SECRET.encode()))
    for proxy in cluster.proxies:
        wait_until(lambda p=proxy: new.url in pools(p)["decode"], 5,
                   f"{proxy.url} to see the engine registered after SIGCONT")
    etcd_delete(cluster.etcd, key)
    for proxy in cluster.proxies:  # leases lapsed while etcd slept: the engines re-register
        wait_until(lambda p=proxy: healthy(p, "prefill") | healthy(p, "decode") == live and
                   new.url not in pools(p)["decode"], 2 * TTL + 5, f"{proxy.url} to converge")
    print(f"\netcd frozen: both proxies noticed after {noticed:.3f} s (idle {IDLE} s)")
    assert [log_lines(p, "unreachable (") for p in cluster.proxies] == [n + 1 for n in lost]
    assert [log_lines(p, "answers again") for p in cluster.proxies] == [n + 1 for n in back]


def test_sigterm_deregisters_before_the_lease_lapses(cluster: Cluster) -> None:
    d2 = cluster.engines.pop("D2")
    stopping = time.monotonic()
    stopper = threading.Thread(target=d2.stop, daemon=True)
    stopper.start()
    wait_until(lambda: all(d2.url not in pools(p)["decode"] for p in cluster.proxies),
               TTL + 3, "both proxies to drop D2")
    took = time.monotonic() - stopping
    stopper.join(30)
    print(f"\nSIGTERM D2: gone from both pools after {took:.3f} s")
    assert took < TTL, f"D2 left only after {took:.2f} s: its lease lapsed, it never revoked"
