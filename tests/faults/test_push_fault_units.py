"""The push writer's fault rules with plain data: a fake transport and clock, no processes.

Each test pins one rule the process-level fault tests rely on:
- P dates a registration by its previous drain, so a P that was frozen refuses it;
- D still sends PUSH_CANCEL to a P it declared dead (a frozen P gets it after the REG);
- P acknowledges a cancel for a registration it holds no more to the agent it came from;
- D frees blocks quarantined for a P whose process is gone at once, and takes a P that
  answers again back;
- P refuses registrations beyond its caps with PUSH_FAIL.
- P pairs by transfer id when both sides have one (never by request ids then), by request
  id only when neither has one, and writes only into a registration of the same prompt
  (digest); any error on its send path is a PUSH_FAIL that frees its blocks;
- D heartbeats a transfer without a transfer id by its base request id.
"""

from __future__ import annotations

import threading

import msgspec
import pytest
from push_fakes import Clock, FakeTransport

from kvconnector import wire
from kvconnector.peers import ALIVE, GONE, SILENT, PeerState
from kvconnector.push.meta import FinishedBlocks, PushMeta, Registration
from kvconnector.push.receiver import Receiver
from kvconnector.push.sender import Sender, SenderStats
from kvconnector.push.thread import PushThread
from kvconnector.security import prompt_digest

TTL, LEASE = 10.0, 5.0
D_AGENT, D_ADDR = "D0-tp0", ("127.0.0.1", 7002)
LOADED = (D_AGENT, "P0-tp0")  # the agents the fake transport has loaded


class FakePeers:
    def __init__(self, agent: str) -> None:
        self.state = PeerState("ready", agent_name=agent, engine_id="X")

    def get(self, addr, tp_rank=None):
        return self.state

    def known_agent(self, addr):
        return self.state.agent_name

    def mark_failed(self, addr, reason: str) -> None:
        self.state.status, self.state.reason = "failed", reason

    def probe(self, addr, on_result) -> None:
        pass

    def revive(self, addr) -> bool:
        revived = self.state.status == "failed"
        self.state.status = "ready"
        return revived

    def forget(self, addr) -> None:
        self.state = PeerState("pending")

    def failed_with_agent(self) -> list:
        return []

    def prune(self, in_use) -> int:
        return 0

    def pending(self) -> bool:
        return False

    def apply_finished(self) -> None:
        pass


def _d_receiver(clock: Clock, t: FakeTransport, peers: FakePeers) -> Receiver:
    return Receiver(t, peers, clock, identity={"decode_engine_id": "D0",
                                               "decode_host": D_ADDR[0],
                                               "decode_port": D_ADDR[1], "decode_tp_size": 1},
                    ttl=TTL, hb_interval=1.0, grace=1.0,
                    stats={"kv_push_registrations_sent_total": 0})


def _p_writer(clock: Clock) -> tuple[PushThread, FakeTransport, Sender]:
    t, peers = FakeTransport(LOADED), FakePeers(D_AGENT)
    sender = Sender(t, peers, clock, lease=LEASE, ttl=TTL, tp_size=1, bytes_per_block=64,
                    stats=SenderStats())
    receiver = Receiver(t, peers, clock, identity={}, ttl=TTL, hb_interval=1.0, grace=1.0,
                        stats={"kv_push_registrations_sent_total": 0})
    return PushThread(t, peers, sender, receiver, threading.Event(), clock), t, sender


PROMPT = list(range(20))
DIGEST = prompt_digest(PROMPT)


def _reg(rid: str, tid: str, digest: str = DIGEST, blocks: tuple[int, ...] = (7, 8)) -> bytes:
    return wire.encode_push_reg(wire.PushReg(
        request_id=rid, transfer_id=tid, decode_engine_id="D0", decode_host=D_ADDR[0],
        decode_port=D_ADDR[1], decode_tp_size=1, local_block_ids=[list(blocks)],
        first_block_index=0, remote_engine_id="P0", remote_host="127.0.0.1",
        remote_port=7001, remote_tp_size=1, prompt_digest=digest))


def _blocks(pid: str, tid: str | None, digest: str = DIGEST,
            blocks: tuple[int, ...] = (3, 4)) -> PushMeta:
    return PushMeta(finished_blocks=[FinishedBlocks(pid, tid, list(blocks), 20, digest)])


def _thawed_p_writes(frozen_for: float) -> tuple[FakeTransport, PushThread]:
    """P drains (nothing), sleeps `frozen_for`, then finds a PUSH_REG and its blocks."""
    clock = Clock()
    writer, t, sender = _p_writer(clock)
    writer.step()
    clock.t += frozen_for
    t.inbox.append((D_AGENT, _reg("d-1", "t-1")))
    writer.inbox.put(_blocks("p-1", "t-1"))
    writer.step()
    return t, writer


def test_a_registration_found_after_a_freeze_longer_than_the_ttl_is_refused():
    t, writer = _thawed_p_writes(frozen_for=TTL + 1)
    assert t.writes == []
    assert t.kinds() == ["PUSH_FAIL"]
    assert writer.collect().finished_sending == {"p-1"}  # P's blocks are free again
    assert not writer.sender.staged and not writer.sender.regs


def test_a_registration_found_after_a_short_pause_is_written():
    t, _ = _thawed_p_writes(frozen_for=TTL / 2)
    assert t.writes == [(D_AGENT, [3, 4], [7, 8])]


def test_d_cancels_at_a_peer_it_declared_dead():
    clock, t = Clock(), FakeTransport(LOADED)
    peers = FakePeers("P0-tp0")
    r = _d_receiver(clock, t, peers)
    r.on_registration(Registration("d-1", "t-1", [7, 8], 0, 20, "P0", "127.0.0.1", 7001, 1))
    r.poll()
    assert t.kinds() == ["PUSH_REG"]
    r.on_probe(("127.0.0.1", 7001), SILENT)
    r.on_probe(("127.0.0.1", 7001), SILENT)  # dead: fail over now ...
    assert "unreachable" in r.failed_recving["d-1"]
    assert peers.state.status == "failed"
    assert t.kinds() == ["PUSH_REG", "PUSH_CANCEL"]  # ... and still tell it
    assert "d-1" in r.quarantine


def test_d_frees_quarantined_blocks_at_once_when_p_is_gone():
    clock, t, peers = Clock(), FakeTransport(LOADED), FakePeers("P0-tp0")
    r = _d_receiver(clock, t, peers)
    p_addr = ("127.0.0.1", 7001)
    for i in range(3):
        r.on_registration(Registration(f"d-{i}", f"t-{i}", [i], 0, 10, "P0", *p_addr, 1))
    r.poll()
    r.on_probe(p_addr, SILENT)
    r.on_probe(p_addr, SILENT)  # declared dead: cancelled, blocks quarantined
    r.on_released("d-0")
    r.on_released("d-1")
    assert set(r.quarantine) == {"d-0", "d-1", "d-2"} and not r.done
    r.on_probe(p_addr, GONE, "P0-tp0")  # the side channel refuses: the process is gone
    assert r.done == {"d-0", "d-1"} and not r.quarantine
    assert peers.state.status == "pending"  # forgotten: the next request handshakes anew
    r.on_released("d-2")
    assert r.done == {"d-0", "d-1", "d-2"}


def test_d_ignores_a_verdict_about_an_agent_it_no_longer_uses():
    clock, t, peers = Clock(), FakeTransport(LOADED), FakePeers("P0-tp0")
    r = _d_receiver(clock, t, peers)
    r.on_registration(Registration("d-0", "t-0", [1], 0, 10, "P0", "127.0.0.1", 7001, 1))
    r.poll()
    r.on_probe(("127.0.0.1", 7001), GONE, "P0-old-agent")
    assert "d-0" in r.waiting and peers.state.status == "ready"


def test_d_takes_back_a_failed_p_that_answers_again():
    clock, t, peers = Clock(), FakeTransport(LOADED), FakePeers("P0-tp0")
    r = _d_receiver(clock, t, peers)
    peers.mark_failed(("127.0.0.1", 7001), "not answering")
    r.on_probe(("127.0.0.1", 7001), ALIVE, "P0-tp0")
    assert peers.state.status == "ready"


def test_p_refuses_registrations_beyond_its_caps(monkeypatch):
    import kvconnector.push.sender as sender_mod

    monkeypatch.setattr(sender_mod, "MAX_REGS_PER_AGENT", 3)
    clock = Clock()
    t, peers = FakeTransport(LOADED), FakePeers(D_AGENT)
    sender = Sender(t, peers, clock, lease=LEASE, ttl=TTL, tp_size=1, bytes_per_block=64,
                    stats=SenderStats(), num_blocks=16)
    for i in range(5):
        sender.on_registration(wire.decode_notif(_reg(f"d-{i}", f"t-{i}")), agent=D_AGENT)
    huge = wire.PushReg(**{**msgspec.structs.asdict(wire.decode_notif(_reg("d-x", "t-x"))),
                           "local_block_ids": [list(range(17))]})
    sender.on_registration(huge, agent=D_AGENT)
    assert sorted(sender.regs) == [("d-0", 0), ("d-1", 0), ("d-2", 0)]
    assert sender.stats.counters["kv_push_registrations_refused_total"] == 3
    assert t.kinds().count("PUSH_FAIL") == 3


def test_p_acks_a_cancel_for_a_registration_it_never_got_to_a_known_agent_only():
    clock = Clock()
    writer, t, sender = _p_writer(clock)
    t.inbox += [(D_AGENT, wire.encode_push_cancel("d-1", "t-1")),
                ("stranger", wire.encode_push_cancel("d-2", "t-2"))]
    writer.step()
    assert t.sent == [(D_AGENT, wire.encode_push_cancel_ack("d-1", "t-1"))]
    # The tombstone makes the ACK true: a late registration is refused, never written.
    t.inbox.append((D_AGENT, _reg("d-1", "t-1")))
    writer.inbox.put(_blocks("p-1", "t-1"))
    writer.step()
    assert t.writes == []
    assert t.kinds()[-1] == "PUSH_FAIL"


def test_p_acks_a_cancel_that_crossed_a_completed_write():
    clock = Clock()
    writer, t, sender = _p_writer(clock)
    t.inbox.append((D_AGENT, _reg("d-1", "t-1")))
    writer.inbox.put(_blocks("p-1", "t-1"))
    writer.step()
    writer.step()
    assert len(t.writes) == 1 and sender.done == set() and not sender.inflight
    t.inbox.append((D_AGENT, wire.encode_push_cancel("d-1", "t-1")))  # completion was lost
    writer.step()
    assert t.sent[-1] == (D_AGENT, wire.encode_push_cancel_ack("d-1", "t-1"))


# --- matching: transfer ids, request ids, prompt digests (issue 15) ----------------------------

OTHER = prompt_digest(list(range(1, 21)))


def _fails(t: FakeTransport) -> list[wire.PushFail]:
    return [m for m in (wire.decode_notif(raw) for _, raw in t.sent)
            if isinstance(m, wire.PushFail)]


def test_transfer_ids_on_both_sides_never_fall_back_to_request_ids():
    writer, t, _ = _p_writer(Clock())
    writer.inbox.put(_blocks("same-0a0b0c0d", "t-1"))
    t.inbox.append((D_AGENT, _reg("same-1a2b3c4d", "t-2")))  # same base id, other transfer
    writer.step()
    writer.step()
    assert t.writes == [] and _fails(t) == []


def test_a_transfer_id_on_one_side_only_matches_nothing():
    writer, t, _ = _p_writer(Clock())
    writer.inbox.put(_blocks("same-0a0b0c0d", None))
    t.inbox.append((D_AGENT, _reg("same-0a0b0c0d", "t-2")))
    writer.step()
    writer.step()
    assert t.writes == []


def test_without_transfer_ids_the_base_request_id_matches():
    writer, t, _ = _p_writer(Clock())
    writer.inbox.put(_blocks("vllm-7-0a0b0c0d", None))
    t.inbox.append((D_AGENT, _reg("vllm-7-1a2b3c4d", "")))
    writer.step()
    assert t.writes == [(D_AGENT, [3, 4], [7, 8])]


def test_a_registration_for_another_prompt_gets_push_fail_and_spoils_the_transfer():
    writer, t, sender = _p_writer(Clock())
    writer.inbox.put(_blocks("p-1", "t-1"))
    t.inbox.append((D_AGENT, _reg("d-1", "t-1", digest=OTHER)))
    writer.step()
    assert t.writes == []
    (fail,) = _fails(t)
    assert fail.request_id == "d-1" and "digest" in fail.reason
    assert sender.stats.counters["kv_push_digest_mismatch_total"] == 1
    assert writer.collect().finished_sending == {"p-1"}
    t.inbox.append((D_AGENT, _reg("d-2", "t-1")))  # a replay, even with the right digest
    writer.step()
    assert t.writes == [] and len(_fails(t)) == 2


def test_a_registration_without_a_digest_is_never_written():
    writer, t, _ = _p_writer(Clock())
    writer.inbox.put(_blocks("p-1", "t-1"))
    t.inbox.append((D_AGENT, _reg("d-1", "t-1", digest="")))
    writer.step()
    assert t.writes == [] and len(_fails(t)) == 1


def test_reused_request_ids_without_transfer_ids_pair_each_prompt_with_its_own_blocks():
    writer, t, _ = _p_writer(Clock())
    t.inbox += [(D_AGENT, _reg("same-1a2b3c4d", "", digest=DIGEST, blocks=(7, 8))),
                (D_AGENT, _reg("same-2a2b3c4d", "", digest=OTHER, blocks=(9, 10)))]
    writer.step()
    writer.inbox.put(_blocks("same-0a0b0c0d", None, digest=OTHER, blocks=(3, 4)))
    writer.inbox.put(_blocks("same-0e0f0a0b", None, digest=DIGEST, blocks=(5, 6)))
    writer.step()
    assert sorted(t.writes) == [(D_AGENT, [3, 4], [9, 10]), (D_AGENT, [5, 6], [7, 8])]
    assert _fails(t) == []


def test_a_heartbeat_by_base_request_id_extends_the_lease_of_a_transfer_without_id():
    clock = Clock()
    writer, t, sender = _p_writer(clock)
    writer.inbox.put(_blocks("vllm-9-0a0b0c0d", None))
    writer.step()
    clock.t += LEASE - 1
    t.inbox.append((D_AGENT, wire.encode_heartbeat(["vllm-9"])))
    writer.step()
    clock.t += 2  # past the first lease, inside the extended one
    writer.step()
    assert "vllm-9-0a0b0c0d" in sender.staged
    clock.t += LEASE
    writer.step()
    assert not sender.staged


@pytest.mark.parametrize("where", ["completion", "write"])
def test_any_error_on_the_send_path_is_push_fail_and_frees_the_blocks(where, monkeypatch):
    writer, t, sender = _p_writer(Clock())
    rid = "d-1"
    if where == "completion":
        rid = "HB:x-1a2b3c4d"  # a completion for this id would read as a heartbeat
    else:
        def broken(*args: object) -> None:
            raise RuntimeError("nixl said no")
        monkeypatch.setattr(t, "write", broken)
    writer.inbox.put(_blocks("p-1", "t-1"))
    t.inbox.append((D_AGENT, _reg(rid, "t-1")))
    writer.step()
    assert [f.request_id for f in _fails(t)] == [rid]
    assert writer.collect().finished_sending == {"p-1"}
    assert not sender.staged and not sender.regs and not sender.inflight


def test_d_heartbeats_a_transfer_without_id_by_its_base_id_and_skips_uncarriable_ids():
    clock, t = Clock(), FakeTransport(LOADED)
    peers = FakePeers("P0-tp0")
    r = _d_receiver(clock, t, peers)
    r.on_registration(Registration("vllm-9-1a2b3c4d", "", [7, 8], 0, 20, "P0", "127.0.0.1",
                                   7001, 1, DIGEST))
    r.on_registration(Registration("a,b-2a2b3c4d", "", [9], 0, 20, "P0", "127.0.0.1",
                                   7001, 1, DIGEST))
    r.poll()
    sent = [wire.decode_notif(m) for _, m in t.sent]
    assert [m.prompt_digest for m in sent if isinstance(m, wire.PushReg)] == [DIGEST, DIGEST]
    assert wire.Heartbeat(("vllm-9",)) in sent
    assert peers.state.status == "ready"  # an id a heartbeat cannot carry is no probe failure


def test_idle_peers_and_their_agents_are_dropped_but_not_while_in_use():
    from kvconnector.peers import Peers

    clock, removed, wake = Clock(), [], threading.Event()

    class Meta:
        def __init__(self, port: int) -> None:
            self.agent_name, self.engine_id = f"agent-{port}", f"E{port}"

    peers = Peers(lambda host, port: Meta(port), lambda meta, source: meta.agent_name, wake,
                  clock, remove_peer=removed.append, idle_after=30.0)
    try:
        a, b = ("127.0.0.1", 7001), ("127.0.0.1", 7002)
        peers.get(a), peers.get(b)
        for _ in range(200):
            peers.apply_finished()
            if peers.table_sizes()["peers_ready"] == 2:
                break
            wake.wait(0.05)
            wake.clear()
        assert peers.table_sizes()["peers_ready"] == 2
        clock.t += 29.0
        assert peers.prune(in_use=set()) == 0  # not idle long enough
        clock.t += 2.0
        assert peers.prune(in_use={b}) == 1  # a is idle; b still carries a transfer
        assert removed == ["agent-7001"] and peers.known_agent(a) is None
        assert peers.known_agent(b) == "agent-7002"
    finally:
        peers.shutdown()


def test_a_probe_tells_a_restarted_p_from_the_one_d_knew():
    from types import SimpleNamespace

    from kvconnector.handshake import HandshakeError
    from kvconnector.peers import probe_verdict

    same = SimpleNamespace(agent_name="P0-tp0", agent_blob=b"blob-1")
    restarted = SimpleNamespace(agent_name="P0-tp0", agent_blob=b"blob-2")  # fixed engine id
    assert probe_verdict(None, same, "P0-tp0", b"blob-1") == ALIVE
    assert probe_verdict(None, restarted, "P0-tp0", b"blob-1") == GONE
    assert probe_verdict(None, SimpleNamespace(agent_name="P9-tp0", agent_blob=b"x"),
                         "P0-tp0", b"blob-1") == GONE
    refused = HandshakeError("127.0.0.1:1", "unreachable", "connection refused")
    assert probe_verdict(refused, None, "P0-tp0", b"blob-1") == GONE
    timeout = HandshakeError("127.0.0.1:1", "timeout", "no reply within 3.0 s")
    assert probe_verdict(timeout, None, "P0-tp0", b"blob-1") == SILENT


@pytest.mark.parametrize("how", ["push_fail", "watchdog", "p_dead"])
def test_every_failed_receipt_is_reported_once(how):
    """`kv_recv_failed_total` is the requests whose remote KV could not be received
    (docs/design.md §3), counted by the scheduler half per reported failure: whichever way
    the receipt failed, it is reported once; a late word on the same request adds nothing."""
    clock, t, peers = Clock(), FakeTransport(LOADED), FakePeers("P0-tp0")
    r = _d_receiver(clock, t, peers)
    r.on_registration(Registration("d-1", "t-1", [7, 8], 0, 20, "P0", "127.0.0.1", 7001, 1))
    r.poll()
    if how == "push_fail":
        r.on_push_fail("d-1", "WRITE submission failed", "P0-tp0")
    elif how == "watchdog":
        r.on_watchdog("d-1")
    else:
        r.on_probe(("127.0.0.1", 7001), SILENT)
        r.on_probe(("127.0.0.1", 7001), SILENT)
    assert "d-1" in r.failed_recving
    r.failed_recving.clear()  # drained by the step
    r.on_push_fail("d-1", "late", "P0-tp0")  # after a cancel: already told
    assert r.failed_recving == {}  # the scheduler half counts each reported failure
