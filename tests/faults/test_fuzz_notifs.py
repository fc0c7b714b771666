"""Garbage on the engine-to-engine channels is counted and dropped; the engines stay healthy.

A NIXL agent in the test process loads P's and D's agents (their side channels hand out the
metadata to anyone, like to a peer engine) and sends them hypothesis-made notifications:
raw bytes, reserved tags with junk bodies, msgpack maps with wrong fields or types, and
well-formed messages about transfers nobody knows. Every message the strict decoder rejects
must show up in `kv_malformed_notifs_total`, exactly; junk on the side channel (a raw ZeroMQ
REQ/DEALER) in `kv_malformed_side_channel_total`. Afterwards both engines answer correctly.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq
from fault_kit import cluster, kv_stat, plain, post, prompts, text_of, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pd_harness import assert_no_leaks

from kvconnector import wire
from kvconnector.handshake import GetMeta, fetch_peer_metadata

TTL = 4.0
TAGS = [b"PUSH_REG:", b"PUSH_FAIL:", b"PUSH_CANCEL:", b"PUSH_CANCEL_ACK:", b"HB:"]
FIELDS = ["request_id", "transfer_id", "decode_engine_id", "decode_host", "decode_port",
          "decode_tp_size", "local_block_ids", "first_block_index", "remote_engine_id",
          "remote_host", "remote_port", "remote_tp_size", "reason", "junk"]
_values = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(),
                    st.text(max_size=20), st.binary(max_size=20),
                    st.lists(st.integers(-5, 1 << 32), max_size=5),
                    st.lists(st.lists(st.integers(-5, 100), max_size=4), max_size=3))
_ids = st.text("abcdef0123456789-", min_size=1, max_size=24)
_valid_reg = st.builds(
    lambda rid, tid, blocks, port: wire.encode_push_reg(wire.PushReg(
        request_id=f"fuzz-{rid}", transfer_id=f"fuzz-{tid}", decode_engine_id="nobody",
        decode_host="127.0.0.1", decode_port=port, decode_tp_size=1,
        local_block_ids=[blocks], first_block_index=0, remote_engine_id="P0",
        remote_host="127.0.0.1", remote_port=1, remote_tp_size=1)),
    _ids, _ids, st.lists(st.integers(0, 1 << 20), min_size=1, max_size=8),
    st.integers(1, 1023))  # privileged ports: nothing listens, the handshake fails fast
NOTIFS = st.one_of(
    st.binary(max_size=200),
    st.builds(lambda tag, body: tag + body, st.sampled_from(TAGS), st.binary(max_size=200)),
    st.builds(lambda tag, m: tag + msgspec.msgpack.encode(m), st.sampled_from(TAGS),
              st.dictionaries(st.sampled_from(FIELDS), _values, max_size=len(FIELDS))),
    st.builds(lambda ids: wire.encode_heartbeat([f"fuzz-{i}" for i in ids]),
              st.lists(_ids, max_size=4)),
    st.builds(lambda rid, why: wire.encode_push_fail(f"fuzz-{rid}", "", why), _ids,
              st.text(max_size=50)),
    st.builds(lambda rid: wire.encode_push_cancel(f"fuzz-{rid}", f"fuzz-{rid}"), _ids),
    st.builds(lambda rid: wire.encode_push_cancel_ack(f"fuzz-{rid}", ""), _ids),
    st.builds(lambda rid, tp: f"fuzz-{rid}:{tp}".encode(), _ids, st.integers(-3, 5000)),
    _valid_reg,
)


def _malformed(raw: bytes) -> bool:
    try:
        wire.decode_notif(raw)
    except wire.MalformedNotif:
        return True
    return False


@pytest.fixture(scope="module")
def dep(tiny_model: str):
    with cluster(tiny_model, name="fuzz",
                 extra={"kv_lease_duration": 2.0, "push_registration_timeout": TTL}) as d:
        yield d


@pytest.fixture(scope="module")
def rogue(dep):
    """A NIXL agent that has loaded both engines' agents: name -> agent name."""
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("fuzzer", nixl_agent_config(enable_prog_thread=False,
                                                  enable_listen_thread=False, backends=["UCX"]))
    names = {}
    for engine_id in ("P0", "D0"):
        meta = fetch_peer_metadata("127.0.0.1", dep.kv_ports[engine_id], None, 5.0)
        name = agent.add_remote_agent(meta.agent_blob)
        names[engine_id] = name.decode() if isinstance(name, bytes) else name
    yield agent, names
    for name in names.values():
        agent.remove_remote_agent(name)


def _serves_correctly(dep, reference, seed: int) -> None:
    ps = prompts(4, seed=seed)

    async def run() -> list[str]:
        return [text_of(r) for r in await asyncio.gather(
            *(post(dep.proxy.url, plain(p), f"after-fuzz-{seed}-{i}") for i, p in enumerate(ps)))]

    assert asyncio.run(run()) == reference(ps)


def test_malformed_notifications_are_counted_and_dropped(dep, rogue, reference):
    agent, names = rogue
    engines = {"P0": dep.p, "D0": dep.d}
    before = {e: kv_stat(s, "kv_malformed_notifs_total") for e, s in engines.items()}
    sent = {"bad": 0, "all": 0}

    @settings(max_examples=60, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(NOTIFS, min_size=1, max_size=6))
    def fuzz(batch: list[bytes]) -> None:
        for raw in batch:
            for name in names.values():
                agent.send_notif(name, raw)
            sent["bad"] += _malformed(raw)
            sent["all"] += 1
        agent.get_new_notifs()  # our side of the transport progresses too

    fuzz()
    oversized = b"HB:" + b"x" * (wire.MAX_NOTIF_BYTES + 1)
    for name in names.values():
        agent.send_notif(name, oversized)
    sent["bad"] += 1
    assert sent["bad"] >= 20 and sent["all"] - sent["bad"] >= 20, sent

    for engine_id, server in engines.items():
        def counted(e=engine_id, s=server) -> bool:
            agent.get_new_notifs()
            return kv_stat(s, "kv_malformed_notifs_total") - before[e] >= sent["bad"]
        wait_for(counted, 30, f"{engine_id} to count {sent['bad']} malformed notifications")
        assert kv_stat(server, "kv_malformed_notifs_total") - before[engine_id] == sent["bad"]
    _serves_correctly(dep, reference, 501)
    # Well-formed registrations for unknown transfers expire with the ttl, nothing else stays.
    assert_no_leaks(dep.engines, timeout=3 * TTL)


def _zmq_exchange(port: int, frames: list[bytes], kind: int = zmq.REQ) -> bytes | None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        if kind == zmq.DEALER:
            sock.send_multipart(frames)
        else:
            sock.send(frames[0])
        if sock.poll(2000, zmq.POLLIN):
            return sock.recv_multipart()[-1]
        return None
    finally:
        sock.close()


def _bad_side_channel_request(body: bytes) -> bool:
    try:
        msgspec.msgpack.Decoder(GetMeta).decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return True
    return False


def test_junk_on_the_side_channel_is_counted_and_answered(dep, reference):
    engines = {"P0": dep.p, "D0": dep.d}
    before = {e: kv_stat(s, "kv_malformed_side_channel_total") for e, s in engines.items()}
    sent = {"bad": 0}

    @settings(max_examples=40, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(st.binary(max_size=512),
                     st.builds(msgspec.msgpack.encode,
                               st.dictionaries(st.sampled_from(["type", "tp_rank", "x"]),
                                               _values, max_size=3))))
    def fuzz(body: bytes) -> None:
        bad = _bad_side_channel_request(body)
        for engine_id in engines:
            reply = _zmq_exchange(dep.kv_ports[engine_id], [body])
            assert reply is not None, "the side channel stopped answering"
            if bad:
                assert b"ERROR" in reply and b"malformed" in reply
        sent["bad"] += bad

    fuzz()
    for engine_id in engines:  # a DEALER with a surplus frame: dropped without an answer
        assert _zmq_exchange(dep.kv_ports[engine_id], [b"a", b"b", b"c"], zmq.DEALER) is None
    sent["bad"] += 1
    assert sent["bad"] >= 10
    for engine_id, server in engines.items():
        wait_for(lambda s=server, e=engine_id: kv_stat(s, "kv_malformed_side_channel_total")
                 - before[e] >= sent["bad"], 10, f"{engine_id} to count the junk")
        assert kv_stat(server, "kv_malformed_side_channel_total") - before[engine_id] == (
            sent["bad"])
        meta = fetch_peer_metadata("127.0.0.1", dep.kv_ports[engine_id], None, 5.0)
        assert meta.engine_id == engine_id  # a real handshake still works
    time.sleep(0.2)
    _serves_correctly(dep, reference, 502)
    assert_no_leaks(dep.engines)
