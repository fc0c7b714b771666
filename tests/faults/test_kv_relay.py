"""Issue 26, findings 1 and 2, played with real engines, a real relay process and real NIXL
agents: a client that reaches D's HTTP port names a side channel of its choosing in a push
D leg.

1. With a KV secret, the side channel is a relay to P's (or D's own) real side channel. Before
   the fix D and P both accepted the relayed handshake (the proofs did not name the endpoint)
   and SIGNED_META crossed the relay in clear: P's agent blob, with which a stranger READ
   every block of P. Now the side channel refuses a proof that names another address, the
   relay records a challenge and a refusal only, and P's next honest push into D goes on.
2. Without a secret, an impostor serves a blob under P's agent name before D ever talked to P.
   Before the fix the name stayed bound to the impostor's address after the impostor was
   gone, so D refused the real P's blob from then on (`kv_refused_peers_total`) and
   recomputed every prompt until it restarted. Now the binding ends with the peer.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
from fault_kit import cluster, kv_stat, legs, plain, post, post_sync, prompts, text_of, wait_for
from nixl_fakes import FakeEngine
from pd_harness import assert_no_leaks

from kvconnector import wire
from kvconnector.handshake import Challenge, ErrorReply, Reply, fetch_peer_metadata

pytestmark = pytest.mark.timeout(240)

SECRET = "relay-test-shared-kv-secret"
RELAY = os.path.join(os.path.dirname(__file__), "..", "kv_relay.py")


@pytest.fixture(scope="module")
def dep(tiny_model: str):
    with cluster(tiny_model, name="relay", with_proxy=False,
                 extra={"kv_lease_duration": 2.0, "push_registration_timeout": 6.0,
                        "kv_peer_allowlist": "127.0.0.0/8", "kv_peer_ports": "1024-65535"},
                 p_args=("--kv-secret", SECRET), d_args=[("--kv-secret", SECRET)]) as d:
        yield d


@pytest.fixture
def relay(tmp_path) -> Iterator:
    """`relay(port)`: a relay process in front of the side channel on `port`; its port and
    the file it records every reply in."""
    procs = []

    def start(port: int) -> tuple[int, str]:
        record = str(tmp_path / f"relay-{port}.hex")
        procs.append(subprocess.Popen([sys.executable, RELAY, "127.0.0.1", str(port), record],
                                      stdout=subprocess.PIPE, text=True))
        return int(procs[-1].stdout.readline()), record

    yield start
    for p in procs:
        p.kill()
        p.wait()


def _recorded(record: str) -> list[Reply]:
    with open(record) as f:
        return [msgspec.msgpack.decode(bytes.fromhex(line), type=Reply) for line in f]


def _attack_leg(dep, prompt: list[int], relay_port: int, tid: str) -> dict:
    _, d_leg = legs(dep, prompt, tid, remote_port=relay_port)
    return d_leg


def _honest_pair(dep, prompt: list[int], tid: str) -> str:
    p_leg, d_leg = legs(dep, prompt, tid)

    async def run() -> str:
        p_r, d_r = await asyncio.gather(post(dep.p.url, p_leg, tid),
                                        post(dep.decodes[0].url, d_leg, tid))
        assert p_r.status_code == 200, p_r.text
        return text_of(d_r)

    return asyncio.run(run())


@pytest.mark.parametrize("target", ["P0", "D0"])
def test_a_relayed_handshake_leaks_no_metadata_and_the_next_push_still_lands(dep, relay,
                                                                             target):
    d, owner = dep.decodes[0], dep.p if target == "P0" else dep.decodes[0]
    relay_port, record = relay(dep.kv_ports[target])
    refused_at_owner = kv_stat(owner, "kv_side_channel_refused_total")
    refused_by_d = kv_stat(d, "kv_handshake_refused_total")
    prompt, honest = prompts(2, seed=2600 + (target == "D0"))
    # The attack: a D leg sent straight to D that names the relay as P's side channel.
    r = post_sync(d.url, _attack_leg(dep, prompt, relay_port, f"relay-{target}"), "atk")
    assert text_of(r) == text_of(post_sync(d.url, plain(prompt), "ref"))  # D recomputed
    replies = _recorded(record)
    assert replies and [type(x) for x in replies] == [Challenge, ErrorReply] * (
        len(replies) // 2)
    assert all(isinstance(x, ErrorReply) and "not this side channel" in x.message
               for x in replies[1::2])
    assert kv_stat(owner, "kv_side_channel_refused_total") >= refused_at_owner + 1
    assert kv_stat(d, "kv_handshake_refused_total") >= refused_by_d + 1
    # Beside it, an honest request: P's KV still lands in D (no binding to the relay).
    writes = kv_stat(dep.p, "kv_push_writes_total")
    tokens = kv_stat(d, "kv_remote_prefill_tokens_total")
    assert _honest_pair(dep, honest, f"honest-{target}") == text_of(
        post_sync(d.url, plain(honest), "ref2"))
    assert kv_stat(dep.p, "kv_push_writes_total") == writes + 1
    assert kv_stat(d, "kv_remote_prefill_tokens_total") >= tokens + len(honest) - 1
    assert kv_stat(d, "kv_refused_peers_total") == 0
    assert_no_leaks(dep.engines)


def test_the_engines_still_serve_metadata_to_a_direct_client_with_the_secret(dep):
    from kvconnector.security import KVSecurity

    meta = fetch_peer_metadata("127.0.0.1", dep.kv_ports["P0"], None, 5.0,
                               security=KVSecurity(SECRET.encode()))
    assert meta.engine_id == "P0"


def test_d_refuses_a_side_channel_outside_its_allowlist_or_ports_before_dialling(dep):
    """Issue 26, finding 7: D dialled any host:port a client named (a port prober). With
    kv_peer_allowlist / kv_peer_ports set, such a D leg is a 400 naming the field, and the
    port named is never connected to."""
    d = dep.decodes[0]
    victim = socket.socket()
    try:
        victim.bind(("127.0.0.1", 1000))  # below kv_peer_ports; binding it needs root
    except PermissionError:
        victim.close()
        pytest.skip("binding a port below 1024 needs root")
    victim.listen()
    victim.setblocking(False)
    try:
        prompt = prompts(1, seed=2603)[0]
        for field, kw in (("remote_port", {"remote_port": 1000}),
                          ("remote_host", {"remote_host": "10.1.2.3"})):
            _, leg = legs(dep, prompt, f"probe-{field}")
            leg["kv_transfer_params"].update(kw)
            r = post_sync(d.url, leg, f"probe-{field}")
            assert r.status_code == 400, r.text
            assert f"kv_transfer_params.{field}" in r.json()["error"]["message"]
        with pytest.raises(BlockingIOError):
            victim.accept()  # nobody knocked
    finally:
        victim.close()
    assert text_of(post_sync(d.url, plain(prompt), "after-probe"))


@pytest.fixture(scope="module")
def open_dep(tiny_model: str):
    """No secret: the impostor can serve a blob, which only the binding rules constrain."""
    with cluster(tiny_model, name="poison", with_proxy=False,
                 extra={"kv_lease_duration": 2.0, "push_registration_timeout": 30.0}) as d:
        yield d


def test_an_impostor_gone_leaves_no_binding_that_keeps_the_real_p_out(open_dep):
    dep, d = open_dep, open_dep.decodes[0]
    real = fetch_peer_metadata("127.0.0.1", dep.kv_ports["P0"], None, 5.0)
    impostor = FakeEngine(real.agent_name, real)  # "P0-tp0", served from another address
    prompt, honest = prompts(2, seed=2602)
    pool = ThreadPoolExecutor(1)
    try:
        _, d_leg = legs(dep, prompt, "poison-1", remote_port=impostor.side.port)
        attack = pool.submit(post_sync, d.url, d_leg, "poison-1")
        # D loaded the impostor's agent and registered its blocks with it.
        impostor.wait_for_notif(wire.PushReg, 60)
    finally:
        impostor.close()  # the impostor's side channel and agent go away
    # D's probe finds nobody at the impostor's address: it frees the blocks and recomputes.
    assert text_of(attack.result(60)) == text_of(post_sync(d.url, plain(prompt), "ref0"))
    wait_for(lambda: kv_stat(d, "kv_peer_gone_total") >= 1, 30, "D to see the impostor gone")
    writes = kv_stat(dep.p, "kv_push_writes_total")
    refused = kv_stat(d, "kv_refused_peers_total")
    assert _honest_pair(dep, honest, "poison-honest") == text_of(
        post_sync(d.url, plain(honest), "ref"))
    assert kv_stat(d, "kv_refused_peers_total") == refused  # the real P was not refused
    assert kv_stat(dep.p, "kv_push_writes_total") == writes + 1  # and its KV landed
    assert_no_leaks(dep.engines)
