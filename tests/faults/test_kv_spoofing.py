"""Notifications from the wrong agent, and an impostor under a real D's agent name, change
nothing: they are refused, counted, and the real transfers go on.

The engines run without a KV secret, so a stranger can load their agents from the side
channel (what the secret prevents; see test_kv_secret.py): this isolates the second line of
defence, the binding of every transfer to the agent it belongs to. The test process plays a
P or a D with a real NIXL agent (to learn the ids a real engine keeps to itself), a stranger
("rogue-tp0") and an impostor named like the real D ("D0-tp0").
"""

from __future__ import annotations

import asyncio
import os

import pytest
from fault_kit import (
    LOG_DIR,
    cluster,
    kv_stat,
    legs,
    plain,
    post,
    prompts,
    table,
    text_of,
    wait_for,
)
from nixl_fakes import FakeEngine
from pd_harness import assert_no_leaks, metric

from kvconnector import wire
from kvconnector.handshake import fetch_peer_metadata
from kvconnector.security import prompt_digest

pytestmark = pytest.mark.timeout(240)

TTL = 4.0
REFUSED = "kv_refused_notifs_total"


@pytest.fixture(scope="module")
def dep(tiny_model: str):
    with cluster(tiny_model, name="spoof",
                 extra={"kv_lease_duration": 2.0, "push_registration_timeout": TTL}) as d:
        yield d


@pytest.fixture(scope="module")
def real_meta(dep):
    return {e: fetch_peer_metadata("127.0.0.1", dep.kv_ports[e], None, 5.0)
            for e in ("P0", "D0")}


@pytest.fixture(scope="module")
def rogue(dep, real_meta):
    """A stranger that has loaded P's and D's agents."""
    fake = FakeEngine("rogue-tp0", real_meta["P0"])
    fake.load(dep.kv_ports["P0"])
    fake.load(dep.kv_ports["D0"])
    yield fake
    fake.close()


@pytest.fixture
def fake(request, real_meta):
    """`fake("fakeP-tp0", "D0")`: a stand-in engine shaped like the real D0 (or P0)."""
    made = []

    def make(name: str, like: str) -> FakeEngine:
        made.append(FakeEngine(name, real_meta[like]))
        return made[-1]

    yield make
    for f in made:
        f.close()


def _refused(server, n: int, what: str) -> None:
    wait_for(lambda: kv_stat(server, REFUSED) >= n, 20, what)
    assert kv_stat(server, REFUSED) == n


def test_a_strangers_completion_push_fail_and_cancel_ack_change_nothing_on_d(
        dep, rogue, fake, reference):
    fake_p = fake("fakeP-tp0", "D0")
    fake_p.load(dep.kv_ports["D0"])  # what P's reverse handshake does
    prompt = prompts(1, seed=701, lo=50, hi=50)[0]
    _, d_leg = legs(dep, prompt, "tid-d-owned", remote_port=fake_p.side.port)
    before = kv_stat(dep.d, REFUSED)
    fallbacks = kv_stat(dep.d, "kv_recompute_fallback_total")

    async def run() -> str:
        task = asyncio.create_task(post(dep.d.url, d_leg, "d-owned"))
        d_agent, reg = await asyncio.to_thread(fake_p.wait_for_notif, wire.PushReg,
                                               transfer_id="tid-d-owned")
        rid = reg.request_id
        # The stranger knows the id (here, from the stand-in P) and says the KV arrived,
        # then that P will not write it: D refuses both and keeps waiting for its P.
        rogue.send(d_agent, wire.encode_completion(rid, 1))
        rogue.send(d_agent, wire.encode_push_fail(rid, "tid-d-owned", "rogue says no"))
        await asyncio.to_thread(_refused, dep.d, before + 2, "D to refuse the stranger")
        assert table(dep.d, "d_waiting") == 1 and not task.done()
        # The request's own P is heard: D recomputes and answers correctly.
        fake_p.send(d_agent, wire.encode_push_fail(rid, "tid-d-owned", "stand-in P gives up"))
        return text_of(await task)

    assert asyncio.run(run()) == reference([prompt])[0]
    assert kv_stat(dep.d, "kv_recompute_fallback_total") == fallbacks + 1
    assert_no_leaks([dep.d])


async def _stream(url: str, body: dict, rid: str) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=60) as c, c.stream(
            "POST", f"{url}/v1/completions", json=body, headers={"X-Request-Id": rid}) as r:
        async for _ in r.aiter_raw():
            pass


def test_a_strangers_cancel_ack_does_not_free_quarantined_blocks(dep, rogue, fake):
    fake_p = fake("fakeP2-tp0", "D0")
    fake_p.load(dep.kv_ports["D0"])
    prompt = prompts(1, seed=702, lo=50, hi=50)[0]
    _, d_leg = legs(dep, prompt, "tid-d-cancel", remote_port=fake_p.side.port, stream=True)
    before = kv_stat(dep.d, REFUSED)

    async def run() -> None:
        task = asyncio.create_task(_stream(dep.d.url, d_leg, "d-cancel"))
        d_agent, reg = await asyncio.to_thread(fake_p.wait_for_notif, wire.PushReg,
                                               transfer_id="tid-d-cancel")
        task.cancel()  # the client goes away: D cancels and quarantines the blocks
        await asyncio.to_thread(fake_p.wait_for_notif, wire.PushCancel,
                                request_id=reg.request_id)
        assert table(dep.d, "d_quarantine") == 1
        rogue.send(d_agent, wire.encode_push_cancel_ack(reg.request_id, "tid-d-cancel"))
        await asyncio.to_thread(_refused, dep.d, before + 1, "D to refuse the stranger's ACK")
        assert table(dep.d, "d_quarantine") == 1  # still quarantined: P may yet write
        fake_p.send(d_agent, wire.encode_push_cancel_ack(reg.request_id, "tid-d-cancel"))
        await asyncio.to_thread(wait_for, lambda: table(dep.d, "d_quarantine") == 0, 10,
                                "P's own ACK to free the blocks")

    asyncio.run(run())
    assert_no_leaks([dep.d])


def test_a_strangers_heartbeat_cancel_and_registration_change_nothing_on_p(
        dep, rogue, fake):
    fake_d = fake("fakeD-tp0", "P0")
    p_agent = fake_d.load(dep.kv_ports["P0"])
    prompt = prompts(1, seed=703, lo=50, hi=50)[0]
    block_size = real_block_size(dep)
    n = -(-len(prompt) // block_size)  # blocks a D registers for the whole prompt

    def reg(rid: str, tid: str, port: int) -> bytes:
        return wire.encode_push_reg(wire.PushReg(
            request_id=rid, transfer_id=tid, decode_engine_id="fakeD", decode_host="127.0.0.1",
            decode_port=port, decode_tp_size=1, local_block_ids=[list(range(n))],
            first_block_index=0, remote_engine_id="P0", remote_host="127.0.0.1",
            remote_port=dep.kv_ports["P0"], remote_tp_size=1,
            prompt_digest=prompt_digest(prompt)))

    received = kv_stat(dep.p, "kv_push_registrations_received_total")
    before = kv_stat(dep.p, REFUSED)
    writes = kv_stat(dep.p, "kv_push_writes_total")
    fake_d.send(p_agent, reg("fake-d-1", "tid-p-owned", fake_d.side.port))
    wait_for(lambda: kv_stat(dep.p, "kv_push_registrations_received_total") > received, 20,
             "P to take the registration")
    # The stranger keeps the transfer's lease alive, cancels it, and re-registers its id.
    rogue.send(p_agent, wire.encode_heartbeat(["tid-p-owned"]))
    rogue.send(p_agent, wire.encode_push_cancel("fake-d-1", "tid-p-owned"))
    rogue.send(p_agent, reg("fake-d-1", "tid-p-owned", fake_d.side.port))
    _refused(dep.p, before + 3, "P to refuse the stranger")
    # P's prefill comes: the WRITE goes to the registering agent, and only there.
    p_leg, _ = legs(dep, prompt, "tid-p-owned")
    assert asyncio.run(post(dep.p.url, p_leg, "p-owned")).status_code == 200
    sender, _ = fake_d.wait_for_notif(wire.Completion, request_id="fake-d-1")
    assert sender == p_agent
    assert bool(fake_d.cache[:n].any()) and rogue.untouched()
    assert kv_stat(dep.p, "kv_push_writes_total") == writes + 1
    # A registration from the stranger naming that D's address: that address serves another
    # agent, so P never writes (nor answers) for it.
    rogue.send(p_agent, reg("rogue-1", "tid-rogue", fake_d.side.port))
    _refused(dep.p, before + 4, "P to refuse a registration for someone else's address")
    assert_no_leaks([dep.p], timeout=3 * TTL)


def test_an_impostor_under_ds_agent_name_does_not_replace_the_real_d(
        dep, fake, reference):
    # P has loaded the real D0 once it served a request through it.
    first = prompts(1, seed=704)[0]
    assert text_of(asyncio.run(post(dep.proxy.url, plain(first), "before-hijack"))) == (
        reference([first])[0])
    impostor = fake("D0-tp0", "P0")  # serves its own blob under the real D's agent name
    p_agent = impostor.load(dep.kv_ports["P0"])
    refused_peers = kv_stat(dep.p, "kv_refused_peers_total")
    impostor.send(p_agent, wire.encode_push_reg(wire.PushReg(
        request_id="hijack-1", transfer_id="tid-hijack", decode_engine_id="D0",
        decode_host="127.0.0.1", decode_port=impostor.side.port, decode_tp_size=1,
        local_block_ids=[[0, 1, 2]], first_block_index=0, remote_engine_id="P0",
        remote_host="127.0.0.1", remote_port=dep.kv_ports["P0"], remote_tp_size=1)))
    wait_for(lambda: kv_stat(dep.p, "kv_refused_peers_total") > refused_peers, 20,
             "P to refuse the impostor's blob")
    # P's next WRITE for D0 still lands in the real D0.
    tokens = metric(dep.d, "pdserve:kv_remote_prefill_tokens_total")
    ps = prompts(2, seed=705)
    texts = [text_of(asyncio.run(post(dep.proxy.url, plain(p), f"after-hijack-{i}")))
             for i, p in enumerate(ps)]
    assert texts == reference(ps)
    assert metric(dep.d, "pdserve:kv_remote_prefill_tokens_total") > tokens
    assert impostor.untouched()
    assert_no_leaks(dep.engines, timeout=3 * TTL)


def test_without_a_secret_each_engine_starts_and_warns_once(dep):
    for engine in ("P0", "D0"):
        with open(os.path.join(LOG_DIR, f"spoof-{engine}.log"), errors="replace") as f:
            assert f.read().count("NO KV SECRET CONFIGURED") == 1


def real_block_size(dep) -> int:
    import httpx

    return int(httpx.get(f"{dep.p.url}/kv_transfer/info", timeout=5).json()["block_size"])
