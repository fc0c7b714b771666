"""NixlTransport and the side channel across real processes, with real NIXL over UCX.

Two host processes (spawned once per module) each hold KV caches, NIXL agents and side-channel
servers, and obey commands sent over a multiprocessing pipe (test plumbing only; the transport's
own traffic is NIXL + ZeroMQ). Tensors are small: 32 blocks of 1 KiB.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
import traceback
from typing import Any

import msgspec
import numpy as np
import psutil
import pytest
import zmq

from kvconnector import wire
from kvconnector.handshake import (
    AgentMetadata,
    ErrorReply,
    HandshakeError,
    SideChannelServer,
    compat_hash,
    fetch_peer_metadata,
)

pytestmark = pytest.mark.timeout(120)

NUM_BLOCKS = 32
BLOCK_SHAPE = (2, 2, 4, 2, 8)  # layers, K/V, block_size, kv heads, head_dim -> 1 KiB float32
HASH = compat_hash("tiny", "float32", 2, 2, 8, 4, "push")


# ---------------------------------------------------------------- host process


def _host_main(conn: Any, seed: int) -> None:
    """Command loop of one host process. Replies ("ok", value) or ("error", type, message)."""
    import torch

    from kvconnector.nixl import NixlTransport
    from kvconnector.transport import make_transport

    transports: dict[str, NixlTransport] = {}
    servers: dict[str, SideChannelServer] = {}
    caches: dict[str, torch.Tensor] = {}
    pending: dict[str, Any] = {}
    notifs: list[tuple[str, str, bytes]] = []
    polling = False

    def poll_all() -> None:
        for tname, t in transports.items():
            notifs.extend((tname, sender, msg) for sender, msg in t.get_new_notifs())

    def wait_state(t: NixlTransport, handle: Any, seconds: float) -> str:
        deadline = time.monotonic() + seconds
        while (state := t.check(handle)) == "PROC" and time.monotonic() < deadline:
            poll_all()
        return state

    def create(name: str, faults: dict | None = None) -> int:
        gen = torch.Generator().manual_seed(seed * 1000 + len(transports))
        cache = torch.randn((NUM_BLOCKS, *BLOCK_SHAPE), generator=gen)
        t = make_transport(name, cache, cache[0].numel() * cache.element_size(),
                          fault_injection=faults, engine_id=f"engine-{name}", block_size=4,
                          compat_hash=HASH, telemetry=True)
        transports[name], caches[name] = t, cache
        servers[name] = SideChannelServer("127.0.0.1", 0, t.local_metadata).start()
        return servers[name].port

    def connect(name: str, port: int, expected: str = HASH) -> str:
        return transports[name].add_peer(fetch_peer_metadata("127.0.0.1", port, expected, 3.0))

    def xfer(name: str, op: str, peer: str, local: list, remote: list, notif: bytes,
             wait_s: float = 5.0) -> tuple:
        t = transports[name]
        handle = (t.write if op == "WRITE" else t.read)(peer, local, remote, notif)
        if wait_s <= 0:
            pending[name] = handle
            return handle.descriptors, None, None
        state = wait_state(t, handle, wait_s)
        used = t.telemetry_descriptors(handle)
        t.release(handle)
        return handle.descriptors, used, state

    def wait_pending(name: str, seconds: float) -> str:
        state = wait_state(transports[name], pending[name], seconds)
        if state != "PROC":
            transports[name].release(pending.pop(name))
        return state

    def take_notifs(wait_s: float, count: int) -> list:
        deadline = time.monotonic() + wait_s
        while len(notifs) < count and time.monotonic() < deadline:
            poll_all()
            time.sleep(0.0005)
        out = list(notifs)
        notifs.clear()
        return out

    def set_polling(on: bool) -> None:
        nonlocal polling
        polling = on

    commands = {
        "create": create, "connect": connect, "xfer": xfer, "wait_pending": wait_pending,
        "notifs": take_notifs, "polling": set_polling,
        "send": lambda name, peer, msg: transports[name].send_notif(peer, msg),
        "cache": lambda name: caches[name].numpy().copy(),
        "fault_counts": lambda name: dict(transports[name].fault_counts),
        "release_pending": lambda name: transports[name].release(pending[name]),
    }
    while True:
        if polling:
            poll_all()
        if not conn.poll(0.001 if polling else 1.0):
            continue
        cmd, *args = conn.recv()
        if cmd == "exit":
            break
        try:
            conn.send(("ok", commands[cmd](*args)))
        except Exception as e:
            conn.send(("error", type(e).__name__, f"{e}\n{traceback.format_exc()}"))
    for server in servers.values():
        server.stop()
    for t in transports.values():
        t.shutdown()
    os._exit(0)  # skip the slow interpreter teardown of torch and the NIXL plugins


class Host:
    def __init__(self, seed: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_host_main, args=(child, seed), daemon=True,
                                name=f"nixl-host-{seed}")
        self.proc.start()

    def call(self, *cmd: Any, timeout: float = 30.0) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"host did not answer {cmd[0]} within {timeout} s")
        reply = self.conn.recv()
        if reply[0] == "error":
            raise RuntimeError(f"{reply[1]}: {reply[2]}")
        return reply[1]

    def close(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("exit",))
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


@pytest.fixture(scope="module")
def hosts():
    p, d = Host(1), Host(2)
    try:
        ports = {"P": p.call("create", "P", timeout=60), "D": d.call("create", "D", timeout=60)}
        ports["PF1"] = p.call("create", "PF1", {"fail_write": True, "max_faults": 1})
        ports["PF2"] = p.call("create", "PF2", {"drop_notif": ["HB", "COMPLETION"]})
        ports["PF3"] = p.call("create", "PF3", {"delay_write_completion_s": 0.6,
                                                "delay_notif": {"PUSH_CANCEL_ACK": 0.3}})
        for name in ("P", "PF1", "PF2", "PF3"):
            assert p.call("connect", name, ports["D"]) == "D"
            assert d.call("connect", "D", ports[name]) == name
        yield p, d, ports
    finally:
        p.close()
        d.close()


def _blocks(cache: np.ndarray, ids: list[int]) -> np.ndarray:
    return cache[ids]


# ---------------------------------------------------------------- transfers


def test_write_lands_exactly_the_listed_blocks_and_nothing_else(hosts) -> None:
    p, d, _ = hosts
    src, before = p.call("cache", "P"), d.call("cache", "D")
    d.call("polling", True)
    local, remote = [1, 2, 3, 8, 20], [5, 6, 7, 30, 0]
    notif = wire.encode_completion("cmpl-x:1-0a1b2c3d", 1)
    descriptors, used, state = p.call("xfer", "P", "WRITE", "D", local, remote, notif)
    got = d.call("notifs", 3.0, 1)
    d.call("polling", False)
    after = d.call("cache", "D")

    assert state == "DONE"
    assert descriptors == 3 and used == 3  # runs: 1-3 -> 5-7, 8 -> 30, 20 -> 0
    np.testing.assert_array_equal(after[remote], src[local])
    untouched = [b for b in range(NUM_BLOCKS) if b not in remote]
    np.testing.assert_array_equal(after[untouched], before[untouched])
    assert [(s, wire.decode_notif(m)) for _, s, m in got] == [
        ("P", wire.Completion("cmpl-x:1-0a1b2c3d", 1))]


def test_contiguous_write_uses_one_descriptor(hosts) -> None:
    p, d, _ = hosts
    src = p.call("cache", "P")
    d.call("polling", True)
    descriptors, used, state = p.call("xfer", "P", "WRITE", "D", list(range(10, 18)),
                                      list(range(12, 20)), wire.encode_completion("r-contig", 1))
    got = d.call("notifs", 3.0, 1)
    d.call("polling", False)
    assert (descriptors, used, state) == (1, 1, "DONE")
    np.testing.assert_array_equal(d.call("cache", "D")[12:20], src[10:18])
    assert [m for _, _, m in got] == [b"r-contig:1"]


def test_read_pulls_remote_blocks_and_notifies_the_owner(hosts) -> None:
    p, d, _ = hosts
    src = p.call("cache", "P")
    p.call("polling", True)
    descriptors, _, state = d.call("xfer", "D", "READ", "P", [24, 26], [4, 5], b"pulled:1")
    got = p.call("notifs", 3.0, 1)
    p.call("polling", False)
    assert state == "DONE" and descriptors == 2
    np.testing.assert_array_equal(d.call("cache", "D")[[24, 26]], src[[4, 5]])
    assert [(t, s, m) for t, s, m in got] == [("P", "D", b"pulled:1")]


def test_write_completes_only_once_the_target_polls(hosts) -> None:
    """Progress thread off: the initiator polling alone is not enough; D must poll too."""
    p, d, _ = hosts
    d.call("polling", False)
    p.call("xfer", "P", "WRITE", "D", [0], [31], b"late:1", 0)
    assert p.call("wait_pending", "P", 0.8) == "PROC"
    d.call("polling", True)
    assert p.call("wait_pending", "P", 5.0) == "DONE"
    got = d.call("notifs", 3.0, 1)
    d.call("polling", False)
    assert [m for _, _, m in got] == [b"late:1"]


def test_in_flight_write_is_never_released_early(hosts) -> None:
    """release() refuses a WRITE still at PROC: a cancel would not undo bytes already copied."""
    p, d, _ = hosts
    d.call("polling", False)
    p.call("xfer", "P", "WRITE", "D", [4], [30], b"inflight:1", 0)
    assert p.call("release_pending", "P") is False
    d.call("polling", True)
    assert p.call("wait_pending", "P", 5.0) == "DONE"  # wait_pending releases it
    assert [m for _, _, m in d.call("notifs", 3.0, 1)] == [b"inflight:1"]
    d.call("polling", False)


def test_standalone_notifications_flow_both_ways(hosts) -> None:
    p, d, _ = hosts
    reg = wire.PushReg("r1-0a0b0c0d", "tx1", "engine-D", "127.0.0.1", 5601, 1, [[3, 4]], 0,
                       "engine-P", "127.0.0.1", 5600, 1)
    d.call("send", "D", "P", wire.encode_push_reg(reg))
    got = p.call("notifs", 3.0, 1)
    assert [(t, s, wire.decode_notif(m)) for t, s, m in got] == [("P", "D", reg)]
    p.call("send", "P", "D", wire.encode_push_cancel_ack("r1-0a0b0c0d", "tx1"))
    got = d.call("notifs", 3.0, 1)
    assert [wire.decode_notif(m) for _, _, m in got] == [wire.PushCancelAck("r1-0a0b0c0d", "tx1")]


# ---------------------------------------------------------------- fault injection


def test_injected_write_failure_raises_then_max_faults_lets_writes_through(hosts) -> None:
    p, d, _ = hosts
    with pytest.raises(RuntimeError, match="TransferError: WRITE to D: injected"):
        p.call("xfer", "PF1", "WRITE", "D", [1], [1], b"f:1")
    d.call("polling", True)
    assert p.call("xfer", "PF1", "WRITE", "D", [1], [1], b"f:1")[2] == "DONE"
    d.call("notifs", 3.0, 1)
    d.call("polling", False)
    assert p.call("fault_counts", "PF1") == {"fail_write": 1}


def test_dropped_notification_kinds_vanish_and_others_pass(hosts) -> None:
    p, d, _ = hosts
    src = p.call("cache", "PF2")
    p.call("send", "PF2", "D", wire.encode_heartbeat(["tx1"]))
    d.call("polling", True)
    assert p.call("xfer", "PF2", "WRITE", "D", [2], [9], b"dropped:1")[2] == "DONE"
    p.call("send", "PF2", "D", wire.encode_push_fail("r", "tx1", "no"))
    got = d.call("notifs", 3.0, 1)
    time.sleep(0.3)
    got += d.call("notifs", 0.0, 0)
    d.call("polling", False)
    assert [wire.notif_kind(m) for _, _, m in got] == ["PUSH_FAIL"]
    np.testing.assert_array_equal(d.call("cache", "D")[9], src[2])  # data still moved
    assert p.call("fault_counts", "PF2") == {"drop_notif:HB": 1, "drop_notif:COMPLETION": 1}


def test_delayed_completion_and_delayed_notif(hosts) -> None:
    p, d, _ = hosts
    d.call("polling", True)
    t0 = time.monotonic()
    assert p.call("xfer", "PF3", "WRITE", "D", [3], [10], b"slow:1")[2] == "DONE"
    assert time.monotonic() - t0 >= 0.6
    p.call("send", "PF3", "D", wire.encode_push_cancel_ack("r", "t"))
    assert d.call("notifs", 0.1, 2) == [("D", "PF3", b"slow:1")]  # the ack is held back
    p.call("polling", True)  # the held-back ack goes out on PF3's next call
    got = d.call("notifs", 3.0, 1)
    p.call("polling", False)
    d.call("polling", False)
    assert [m for _, _, m in got] == [wire.encode_push_cancel_ack("r", "t")]


def test_injected_handshake_failure_names_the_peer(hosts) -> None:
    p, _, ports = hosts
    p.call("create", "PF4", {"fail_handshake": True})
    with pytest.raises(RuntimeError, match="HandshakeError: KV handshake with D failed: injected"):
        p.call("connect", "PF4", ports["D"])


# ---------------------------------------------------------------- handshake


def test_incompatible_compat_hash_is_refused_naming_the_peer(hosts) -> None:
    p, _, ports = hosts
    with pytest.raises(RuntimeError) as err:
        p.call("connect", "P", ports["D"], "0123456789abcdef")
    msg = str(err.value)
    assert "HandshakeError" in msg and f"127.0.0.1:{ports['D']}" in msg
    assert "incompatible compat hash" in msg and HASH in msg


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_wrong_port_fails_fast_naming_host_and_port() -> None:
    port = _closed_port()
    t0 = time.monotonic()
    with pytest.raises(HandshakeError, match=f"127.0.0.1:{port}.*unreachable") as err:
        fetch_peer_metadata("127.0.0.1", port, HASH, timeout_s=5.0)
    assert time.monotonic() - t0 < 1.0
    assert err.value.peer == f"127.0.0.1:{port}"


def test_silent_peer_times_out_naming_host_and_port() -> None:
    with socket.socket() as s:  # accepts TCP (backlog) but never speaks ZeroMQ
        s.bind(("127.0.0.1", 0))
        s.listen(4)
        port = s.getsockname()[1]
        with pytest.raises(HandshakeError, match=f"127.0.0.1:{port}.*timeout"):
            fetch_peer_metadata("127.0.0.1", port, HASH, timeout_s=0.5)


def _meta(tp_rank: int = 0) -> AgentMetadata:
    return AgentMetadata("agent-x", b"blob", 4096, 8, 1024, 16, tp_rank, 1, "engine-x", HASH)


def test_malformed_side_channel_messages_are_counted_and_server_keeps_answering() -> None:
    with SideChannelServer("127.0.0.1", 0, _meta) as server:
        ctx = zmq.Context.instance()
        req = ctx.socket(zmq.REQ)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(f"tcp://127.0.0.1:{server.port}")
        for bad in (b"garbage", msgspec.msgpack.encode({"type": "GET_META", "tp_rank": -1}),
                    msgspec.msgpack.encode({"type": "NOPE"})):
            req.send(bad)
            assert req.poll(3000)
            assert isinstance(msgspec.msgpack.decode(req.recv(), type=ErrorReply), ErrorReply)
        req.close()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{server.port}")
        dealer.send_multipart([b"a", b"b", b"c"])  # wrong envelope: dropped, no reply
        deadline = time.monotonic() + 3
        while server.malformed_count < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        dealer.close()
        assert server.malformed_count == 4
        assert fetch_peer_metadata("127.0.0.1", server.port, HASH, 3.0) == _meta()
        assert server._thread.is_alive() and server._thread.name.startswith("pdserve-kv-side")
    assert not server._thread.is_alive()


def test_wrong_tp_rank_is_an_error_reply_not_a_crash() -> None:
    with SideChannelServer("127.0.0.1", 0, _meta) as server:
        with pytest.raises(HandshakeError, match="error reply.*tp_rank 0, not 3"):
            fetch_peer_metadata("127.0.0.1", server.port, HASH, 3.0, tp_rank=3)
        assert fetch_peer_metadata("127.0.0.1", server.port, None, 3.0).engine_id == "engine-x"


def test_side_channel_bind_conflict_raises_from_start() -> None:
    with SideChannelServer("127.0.0.1", 0, _meta) as first:
        with pytest.raises(OSError, match=f"127.0.0.1:{first.port}"):
            SideChannelServer("127.0.0.1", first.port, _meta).start()


def test_compat_hash_is_short_stable_and_sensitive() -> None:
    base = ("m", "float32", 2, 2, 8, 16, "push")
    assert compat_hash(*base) == compat_hash(*base) and len(compat_hash(*base)) == 16
    for i, other in enumerate(("m2", "bfloat16", 3, 4, 16, 32, "pull")):
        changed = list(base)
        changed[i] = other
        assert compat_hash(*changed) != compat_hash(*base)


# ---------------------------------------------------------------- idle cost


def test_idle_agent_without_progress_thread_uses_almost_no_cpu(hosts) -> None:
    p, d, _ = hosts
    p.call("polling", False)
    d.call("polling", False)
    time.sleep(0.3)
    proc = psutil.Process(p.proc.pid)
    before = proc.cpu_times()
    time.sleep(3.0)
    after = proc.cpu_times()
    used = (after.user - before.user) + (after.system - before.system)
    assert used < 0.02 * 3.0, f"idle host with 4 NIXL agents used {used:.3f} s CPU in 3 s"


# ---------------------------------------------------------------- peer death and the bench


def test_dead_peer_fails_in_flight_and_new_transfers_instead_of_hanging(hosts) -> None:
    p, _, _ = hosts
    d = Host(4)
    try:
        p_port, d_port = p.call("create", "P2"), d.call("create", "D2", timeout=60)
        p.call("connect", "P2", d_port)
        d.call("connect", "D2", p_port)
        p.call("xfer", "P2", "WRITE", "D2", [1], [2], b"doomed:1", 0)  # D2 never polls
        d.proc.kill()
        d.proc.join(10)
        t0 = time.monotonic()
        assert p.call("wait_pending", "P2", 20.0) == "ERR"
        assert time.monotonic() - t0 < 10
        with pytest.raises(RuntimeError, match="TransferError: WRITE to D2: submission failed"):
            p.call("xfer", "P2", "WRITE", "D2", [1], [2], b"x:1")
        with pytest.raises(RuntimeError, match="TransferError: notification to D2 failed"):
            p.call("send", "P2", "D2", wire.encode_heartbeat(["t"]))
    finally:
        d.close()


def _bench_config(tmp_path) -> str:
    """A model dir with just the config bench_transfer reads: 2 layers, 2 KV heads of 16."""
    import json

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "hidden_size": 64}))
    return str(model)


def test_bench_transfer_reports_design_keys_and_moves_the_right_bytes(tmp_path) -> None:
    from pdserve.bench import transfer as bench_transfer

    model = _bench_config(tmp_path)
    result = bench_transfer.run(model, num_tokens=100, block_size=16, iters=2, warmup=1,
                                layout="scattered")
    assert {"bytes", "descriptors", "gbps", "memcpy_gbps", "ratio",
            "memcpy_back_to_back_gbps"} <= set(result)
    assert result["memcpy_back_to_back_gbps"] > 0
    assert result["bytes"] == 7 * 2 * 2 * 16 * 2 * 16 * 4  # ceil(100/16) blocks
    assert result["descriptors"] == 7 and result["verified"] is True
    assert result["gbps"] > 0 and result["ratio"] == pytest.approx(
        result["gbps"] / result["memcpy_gbps"], rel=0.01)


def test_bench_transfer_split_heads_writes_half_the_heads_as_runs(tmp_path) -> None:
    """P holds KV head 0 of 2 (a TP=2 rank) and writes it into D's blocks holding both: one
    descriptor per (block, layer, K/V, token), landing in head 0 of D's blocks only."""
    from pdserve.bench import transfer as bench_transfer

    model = _bench_config(tmp_path)
    result = bench_transfer.run(model, num_tokens=100, block_size=16, iters=2, warmup=1,
                                layout="scattered", split_heads=True)
    assert result["bytes"] == 7 * 2 * 2 * 16 * 1 * 16 * 4  # one of the 2 heads
    assert result["descriptors"] == 7 * 2 * 2 * 16 and result["whole_descriptors"] == 7
    assert result["verified"] is True and result["split_over_whole_write_time"] > 0


# ---------------------------------------------------------------- in-process details


def test_fault_injection_config_is_strict() -> None:
    from kvconnector.faults import FaultInjection

    with pytest.raises(ValueError, match="unknown key"):
        FaultInjection.from_dict({"fail_writes": True})
    with pytest.raises(ValueError, match="unknown notification kind"):
        FaultInjection.from_dict({"drop_notif": ["PUSH_REGISTER"]})
    with pytest.raises(ValueError, match="probability"):
        FaultInjection.from_dict({"fail_write": True, "probability": 2})
    parsed = FaultInjection.from_dict({"drop_notif": ["HB"], "delay_notif": {"PUSH_FAIL": 1}})
    assert parsed.drop_notif == frozenset({"HB"}) and parsed.delay_notif == {"PUSH_FAIL": 1.0}
    from kvconnector.faults import for_rank

    with pytest.raises(ValueError, match="by_rank maps tensor-parallel ranks"):
        for_rank({"by_rank": {"one": {"fail_write": True}}}, 1)
    faults = {"fail_read": True, "by_rank": {"1": {"fail_write": True, "fail_read": False}}}
    assert for_rank(faults, 0) == {"fail_read": True}
    assert for_rank(faults, 1) == {"fail_read": False, "fail_write": True}


def test_count_runs_counts_runs_consecutive_on_both_sides() -> None:
    from kvconnector.nixl import count_runs

    assert count_runs([1, 2, 3, 8, 20], [5, 6, 7, 30, 0]) == 3
    assert count_runs([0, 1, 2], [4, 6, 7]) == 2
    assert count_runs(list(range(100)), list(range(50, 150))) == 1
    assert count_runs([], []) == 0


def test_seeded_probabilistic_faults_repeat_exactly() -> None:
    """Soak tests rely on it: the same seed injects the same faults in the same order."""
    import torch

    from kvconnector.nixl import NixlTransport, TransferError
    from kvconnector.transport import make_transport

    faults = {"fail_write": True, "probability": 0.5, "seed": 11}
    caches = [torch.zeros((NUM_BLOCKS, *BLOCK_SHAPE)) for _ in range(3)]
    bpb = caches[0][0].numel() * 4
    a = make_transport("seeded-a", caches[0], bpb, fault_injection=faults)
    b = make_transport("seeded-b", caches[1], bpb, fault_injection=faults)
    sink = NixlTransport("seeded-sink", caches[2], bpb)
    try:
        patterns = []
        for t in (a, b):
            t.add_peer(sink.local_metadata())
            outcome = []
            for i in range(24):
                try:
                    handle = t.write("seeded-sink", [i], [i])
                except TransferError:
                    outcome.append(False)
                    continue
                while t.check(handle) == "PROC":
                    sink.get_new_notifs()
                assert t.release(handle)
                outcome.append(True)
            patterns.append(outcome)
        assert patterns[0] == patterns[1] and 0 < sum(patterns[0]) < 24
        assert a.fault_counts == {"fail_write": 24 - sum(patterns[0])}
    finally:
        for t in (a, b, sink):
            t.shutdown()


def test_faults_by_rank_spare_the_other_ranks() -> None:
    """`by_rank` makes one rank of a TP engine fail while the others write (TP fault tests)."""
    import torch

    from kvconnector.nixl import NixlTransport, TransferError
    from kvconnector.transport import make_transport

    faults = {"by_rank": {"1": {"fail_write": True}}}
    caches = [torch.zeros((NUM_BLOCKS, *BLOCK_SHAPE)) for _ in range(3)]
    bpb = caches[0][0].numel() * 4
    ranks = [make_transport(f"ranks-{r}", caches[r], bpb, fault_injection=faults, tp_rank=r,
                           tp_size=2) for r in (0, 1)]
    sink = NixlTransport("ranks-sink", caches[2], bpb)
    try:
        for t in ranks:
            t.add_peer(sink.local_metadata())
        handle = ranks[0].write("ranks-sink", [1], [1])
        while ranks[0].check(handle) == "PROC":
            sink.get_new_notifs()
        assert ranks[0].release(handle) and ranks[0].fault_counts == {}
        with pytest.raises(TransferError, match="injected"):
            ranks[1].write("ranks-sink", [2], [2])
        assert ranks[1].fault_counts == {"fail_write": 1}
    finally:
        for t in (*ranks, sink):
            t.shutdown()


def test_a_peer_of_another_tp_size_pairs_by_heads_and_a_foreign_split_is_refused() -> None:
    """In one process: a TP=2 rank (head 1 of 2) loads a TP=1 peer holding both heads without
    preparing its blocks; a peer claiming another model's split is refused, naming both."""
    import torch

    from kvconnector.nixl import NixlTransport, TransferError
    from kvconnector.tp_layout import HeadLayout

    def transport(name: str, heads: int, first: int, total: int, tp: int) -> NixlTransport:
        layout = HeadLayout(2, 4, heads, first, total, 8, 4)
        cache = torch.zeros(8, 2, 2, 4, heads, 8)
        return NixlTransport(name, cache, layout.bytes_per_block, engine_id=name, block_size=4,
                             compat_hash=HASH, layout=layout, tp_rank=first // heads,
                             tp_size=tp)

    p1, d, odd = transport("p-tp1", 1, 1, 2, 2), transport("d", 2, 0, 2, 1), None
    try:
        assert p1.add_peer(d.local_metadata(), "d:1") == "d"
        assert p1._peers["d"].dlist is None and p1._peers["d"].layout.heads == 2
        odd = transport("odd", 2, 0, 4, 2)  # 2 of 4 heads: another model's split
        with pytest.raises(TransferError, match="not a split of the same model's heads"):
            p1.add_peer(odd.local_metadata(), "odd:1")
    finally:
        for t in (p1, d, odd):
            if t is not None:
                t.shutdown()
