"""Push between engines of different TP sizes, with plain data (docs/design.md §8): a fake
transport and peers, no processes.

- D TP=1 from P TP=2: one part per P rank, each its own PUSH_REG to P's kv_port + p; the KV
  has landed only when both P ranks' WRITEs completed; a failure from either fails the
  request once, and its blocks stay until the other P rank can no longer write (its ack).
- P TP=1 to D TP=2: P takes one registration per D rank for the same request, WRITEs them
  all at once (each as soon as it is registered) and frees its blocks after the last WRITE
  is over; a failed WRITE fails a D rank not written yet.
"""

from __future__ import annotations

from push_fakes import Clock, FakeTransport

from kvconnector import wire
from kvconnector.peers import PeerState
from kvconnector.push.meta import FinishedBlocks, Registration
from kvconnector.push.receiver import Receiver
from kvconnector.push.sender import Sender, SenderStats
from kvconnector.security import prompt_digest

HOST, P_PORT, D_PORT = "127.0.0.1", 7001, 7101
PROMPT = list(range(20))
DIGEST = prompt_digest(PROMPT)


class AgentPeers:
    """Every address ready, serving agent `<name>-tp<port - base>`."""

    def __init__(self, name: str, base: int) -> None:
        self.name, self.base = name, base
        self.asked: dict[tuple[str, int], int | None] = {}

    def get(self, addr, tp_rank=None):
        self.asked.setdefault(addr, tp_rank)
        return PeerState("ready", agent_name=self.known_agent(addr))

    def known_agent(self, addr):
        return f"{self.name}-tp{addr[1] - self.base}"

    def probe(self, addr, on_result) -> None:
        pass

    def failed_with_agent(self) -> list:
        return []


def _receiver(t: FakeTransport, peers: AgentPeers) -> Receiver:
    identity = {"decode_engine_id": "D0", "decode_host": HOST, "decode_port": D_PORT,
                "decode_tp_size": 1, "decode_tp_rank": 0}
    return Receiver(t, peers, Clock(), identity=identity, ttl=10.0, hb_interval=1.0,
                    grace=1.0, stats={"kv_push_registrations_sent_total": 0},
                    tp_rank=0, tp_size=1)


def _registered(r: Receiver, t: FakeTransport) -> list[wire.PushReg]:
    r.on_registration(Registration("d-0", "t-0", [3, 4], 0, 20, "P0", HOST, P_PORT, 2,
                                   DIGEST))
    r.poll()
    return [wire.decode_notif(m) for _, m in t.sent if m.startswith(b"PUSH_REG:")]


def test_d_registers_with_every_p_rank_and_lands_only_when_all_wrote():
    t, peers = FakeTransport(), AgentPeers("P0", P_PORT)
    r = _receiver(t, peers)
    regs = _registered(r, t)
    assert [a for a, m in t.sent if m.startswith(b"PUSH_REG:")] == ["P0-tp0", "P0-tp1"]
    assert [(g.remote_port, g.remote_tp_size, g.decode_tp_rank) for g in regs] == [
        (P_PORT, 2, 0), (P_PORT + 1, 2, 0)]
    assert peers.asked == {(HOST, P_PORT): 0, (HOST, P_PORT + 1): 1}  # each rank's handshake
    r.on_completion("d-0", "P0-tp1")
    assert not r.finished_recving and r.table_sizes()["d_waiting"] == 1
    r.on_completion("d-0", "P0-tp1")  # a second completion of the same part changes nothing
    assert not r.finished_recving
    r.on_completion("d-0", "P0-tp0")
    assert r.finished_recving == {"d-0"} and not r.done
    r.on_released("d-0")
    assert r.done == {"d-0"} and not r.requests


def test_d_fails_once_on_either_p_rank_and_frees_only_when_both_are_safe():
    t, peers = FakeTransport(), AgentPeers("P0", P_PORT)
    r = _receiver(t, peers)
    _registered(r, t)
    r.on_push_fail("d-0", "WRITE failed", "P0-tp1")
    assert list(r.failed_recving) == ["d-0"]
    r.failed_recving.clear()
    r.on_watchdog("d-0")  # P rank 0's part times out later: not reported a second time
    assert not r.failed_recving and "d-0" in r.quarantine
    assert wire.decode_notif(t.sent[-1][1]) == wire.PushCancel("d-0", "t-0")
    assert t.sent[-1][0] == "P0-tp0"
    r.on_released("d-0")
    assert not r.done  # P rank 0 may still write
    r.on_cancel_ack("d-0", "P0-tp1")  # not the agent of the part still quarantined
    assert not r.done and r.refused == 1
    r.on_cancel_ack("d-0", "P0-tp0")
    assert r.done == {"d-0"} and not r.requests and not r.finished_recving


def _reg(rank: int) -> wire.PushReg:
    return wire.PushReg(
        request_id="d-0", transfer_id="t-0", decode_engine_id="D0", decode_host=HOST,
        decode_port=D_PORT + rank, decode_tp_size=2, local_block_ids=[[7, 8]],
        first_block_index=0, remote_engine_id="P0", remote_host=HOST, remote_port=P_PORT,
        remote_tp_size=1, prompt_digest=DIGEST, decode_tp_rank=rank)


def _sender(t: FakeTransport, peers: AgentPeers) -> Sender:
    return Sender(t, peers, Clock(), lease=5.0, ttl=10.0, tp_size=1, bytes_per_block=64,
                  stats=SenderStats(), tp_rank=0)


class PerWrite(FakeTransport):
    """Each WRITE's handle is its index; its state is `states[index]` ("PROC" until set)."""

    def __init__(self, loaded: tuple[str, ...] = ()) -> None:
        super().__init__(loaded)
        self.states: dict[int, str] = {}

    def write(self, agent: str, p_ids: list[int], d_ids: list[int], notif: bytes) -> object:
        super().write(agent, p_ids, d_ids, notif)
        return len(self.writes) - 1

    def check(self, handle: object) -> str:
        return self.states.get(handle, "PROC")


def test_p_writes_every_registered_d_rank_at_once_and_frees_after_the_last():
    """P TP=1 -> D TP=2: both D ranks' WRITEs are in flight together (neither waits for the
    other), and P's blocks go only once the last of them is over."""
    t, peers = PerWrite(("D0-tp0", "D0-tp1")), AgentPeers("D0", D_PORT)
    s = _sender(t, peers)
    s.on_registration(_reg(1), agent="D0-tp1")
    s.on_finished_blocks(FinishedBlocks("p-0", "t-0", [1, 2], 20, DIGEST))
    s.on_registration(_reg(0), agent="D0-tp0")
    assert peers.asked == {(HOST, D_PORT + 1): 1, (HOST, D_PORT): 0}
    s.poll()
    assert sorted(w[0] for w in t.writes) == ["D0-tp0", "D0-tp1"]
    assert len(s.inflight) == 2 and s.table_sizes()["p_inflight"] == 2 and not s.regs
    t.states[1] = "DONE"
    s.poll()  # one WRITE over, the other still reads P's blocks: they stay
    assert not s.done and len(s.inflight) == 1
    t.states[0] = "DONE"
    s.poll()
    assert s.done == {"p-0"} and not s.staged and not s.regs
    assert s.stats.counters["kv_push_writes_total"] == 2


def test_p_writes_a_late_d_rank_when_its_registration_comes():
    t, peers = FakeTransport(("D0-tp0", "D0-tp1")), AgentPeers("D0", D_PORT)
    s = _sender(t, peers)
    s.on_registration(_reg(0), agent="D0-tp0")
    s.on_finished_blocks(FinishedBlocks("p-0", "t-0", [1, 2], 20, DIGEST))
    s.poll()  # rank 0 written; waiting for rank 1's registration (the lease bounds it)
    assert not s.done and len(s.staged) == 1 and len(t.writes) == 1
    s.on_registration(_reg(1), agent="D0-tp1")
    s.poll()
    assert [w[0] for w in t.writes] == ["D0-tp0", "D0-tp1"]
    assert s.done == {"p-0"} and not s.staged and not s.regs


def test_p_fails_the_other_d_rank_when_a_write_fails():
    t, peers = PerWrite(("D0-tp0", "D0-tp1")), AgentPeers("D0", D_PORT)
    s = _sender(t, peers)
    s.on_registration(_reg(0), agent="D0-tp0")
    s.on_registration(_reg(1), agent="D0-tp1")
    s.on_finished_blocks(FinishedBlocks("p-0", "t-0", [1, 2], 20, DIGEST))
    s.poll()
    t.states[0] = "ERR"
    s.poll()  # rank 0's WRITE failed; rank 1's still reads P's blocks: they stay
    fails = [(a, wire.decode_notif(m)) for a, m in t.sent if m.startswith(b"PUSH_FAIL:")]
    assert [a for a, _ in fails] == ["D0-tp0"] and not s.done
    t.states[1] = "DONE"
    s.poll()
    assert len(t.writes) == 2 and s.done == {"p-0"} and not s.regs and not s.staged
    # a failed WRITE before a D rank registered: that rank's late registration is refused
    t2 = FakeTransport(("D0-tp0", "D0-tp1"))
    t2.check = lambda handle: "ERR"  # type: ignore[method-assign]
    s2 = _sender(t2, peers)
    s2.on_registration(_reg(0), agent="D0-tp0")
    s2.on_finished_blocks(FinishedBlocks("p-0", "t-0", [1, 2], 20, DIGEST))
    s2.poll()
    assert s2.done == {"p-0"}
    s2.on_registration(_reg(1), agent="D0-tp1")  # tombstone
    assert not s2.regs and [a for a, m in t2.sent if m.startswith(b"PUSH_FAIL:")] == [
        "D0-tp0", "D0-tp1"]


def test_p_refuses_a_registration_from_a_d_rank_holding_none_of_its_heads():
    t, peers = FakeTransport(("D0-tp0",)), AgentPeers("D0", D_PORT)
    s = Sender(t, peers, Clock(), lease=5.0, ttl=10.0, tp_size=2, bytes_per_block=64,
               stats=SenderStats(), tp_rank=1)
    s.on_registration(_reg(0), agent="D0-tp0")  # D TP=2 rank 0 holds P TP=2 rank 0's heads
    assert not s.regs and s.stats.counters["kv_push_registrations_refused_total"] == 1


class SlowWrite(FakeTransport):
    state = "PROC"

    def check(self, handle: object) -> str:
        return self.state


def test_p_cancels_one_d_ranks_registration_while_writing_another():
    t, peers = SlowWrite(("D0-tp0", "D0-tp1")), AgentPeers("D0", D_PORT)
    s = _sender(t, peers)
    s.on_registration(_reg(0), agent="D0-tp0")
    s.on_finished_blocks(FinishedBlocks("p-0", "t-0", [1, 2], 20, DIGEST))
    s.poll()  # the WRITE to D rank 0 is in flight
    s.on_registration(_reg(1), agent="D0-tp1")  # matched; cancelled before it is posted
    assert [w[0] for w in t.writes] == ["D0-tp0"] and list(s.regs) == [("d-0", 1)]
    s.on_cancel("d-0", "t-0", agent="D0-tp1")
    assert not s.regs and s.refused == 0
    assert [(a, wire.decode_notif(m)) for a, m in t.sent
            if m.startswith(b"PUSH_CANCEL_ACK:")] == [("D0-tp1", wire.PushCancelAck("d-0",
                                                                                  "t-0"))]
    assert len(s.inflight) == 1  # D rank 0's WRITE goes on; its own cancel would wait for it
    t.state = "DONE"
    s.poll()  # rank 0 written; rank 1 cancelled: the blocks go now, not at lease expiry
    assert s.done == {"p-0"} and not s.staged and [w[0] for w in t.writes] == ["D0-tp0"]


def test_p_frees_its_blocks_when_a_d_rank_cancels_between_writes():
    t, peers = SlowWrite(("D0-tp0", "D0-tp1")), AgentPeers("D0", D_PORT)
    t.state = "DONE"
    s = _sender(t, peers)
    s.on_registration(_reg(0), agent="D0-tp0")
    s.on_finished_blocks(FinishedBlocks("p-0", "t-0", [1, 2], 20, DIGEST))
    s.poll()  # rank 0 written; waiting for rank 1's registration
    s.on_registration(_reg(1), agent="D0-tp1")
    assert not s.done and s.staged["p-0"].state.name == "MATCHED"
    s.on_cancel("d-0", "t-0", agent="D0-tp1")
    assert s.done == {"p-0"} and not s.staged and not s.regs and len(t.writes) == 1


def test_p_frees_at_once_the_blocks_of_a_transfer_cancelled_before_its_prefill_ended():
    """D rank 0 cancels while P still prefills (acknowledged at once: nothing of it is in
    flight); when the prefill ends its blocks go then, not at lease expiry, and D rank 1's
    registration gets PUSH_FAIL."""
    t, peers = FakeTransport(("D0-tp0", "D0-tp1")), AgentPeers("D0", D_PORT)
    s = _sender(t, peers)
    s.on_registration(_reg(0), agent="D0-tp0")
    s.on_registration(_reg(1), agent="D0-tp1")
    s.on_cancel("d-0", "t-0", agent="D0-tp0")
    s.poll()
    assert [a for a, m in t.sent if m.startswith(b"PUSH_CANCEL_ACK:")] == ["D0-tp0"]
    s.on_finished_blocks(FinishedBlocks("p-0", "t-0", [1, 2], 20, DIGEST))
    s.poll()
    assert s.done == {"p-0"} and not s.staged and not s.regs and not t.writes
    assert [a for a, m in t.sent if m.startswith(b"PUSH_FAIL:")] == ["D0-tp1"]
    assert s.stats.counters["kv_lease_expired_total"] == 0
