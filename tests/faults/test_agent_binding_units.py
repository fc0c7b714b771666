"""Which agent may act on a transfer, with plain data: a fake transport, peers and clock.

The process-level proofs are in test_kv_spoofing.py; these pin the orderings a live test
cannot force: a registration whose reverse handshake is still pending when it matches, a
PUSH_FAIL queued for an address that turns out to serve another agent.
"""

from __future__ import annotations

from push_fakes import FakeTransport

from kvconnector import wire
from kvconnector.peers import PeerState
from kvconnector.push.meta import FinishedBlocks, Registration
from kvconnector.push.receiver import Receiver
from kvconnector.push.sender import Sender, SenderStats
from kvconnector.security import prompt_digest

D_ADDR, P_ADDR = ("127.0.0.1", 7002), ("127.0.0.1", 7001)


class Peers:
    """Handshakes finish when the test says so."""

    def __init__(self) -> None:
        self.states: dict[tuple[str, int], PeerState] = {}

    def get(self, addr, tp_rank=None):
        return self.states.setdefault(addr, PeerState("pending"))

    def finish(self, addr, agent: str) -> None:
        self.states[addr] = PeerState("ready", agent_name=agent)

    def known_agent(self, addr):
        state = self.states.get(addr)
        return state.agent_name if state else None

    def probe(self, addr, on_result) -> None:
        pass

    def failed_with_agent(self) -> list:
        return []


def _sender() -> tuple[Sender, FakeTransport, Peers]:
    t, peers = FakeTransport(), Peers()
    sender = Sender(t, peers, lambda: 100.0, lease=5.0, ttl=10.0, tp_size=1,
                    bytes_per_block=64, stats=SenderStats())
    return sender, t, peers


DIGEST = prompt_digest(list(range(20)))


def _reg(rid: str, tid: str) -> wire.PushReg:
    return wire.PushReg(
        request_id=rid, transfer_id=tid, decode_engine_id="D0", decode_host=D_ADDR[0],
        decode_port=D_ADDR[1], decode_tp_size=1, local_block_ids=[[7, 8]], first_block_index=0,
        remote_engine_id="P0", remote_host=P_ADDR[0], remote_port=P_ADDR[1], remote_tp_size=1,
        prompt_digest=DIGEST)


def test_p_never_writes_for_a_registration_whose_address_serves_another_agent():
    sender, t, peers = _sender()
    sender.on_registration(_reg("d-1", "t-1"), agent="rogue-tp0")
    sender.on_finished_blocks(FinishedBlocks("p-1", "t-1", [3, 4], 20, DIGEST))
    peers.finish(D_ADDR, "D0-tp0")  # the address the rogue named is the real D's
    sender.poll()
    assert t.writes == [] and t.sent == []  # no WRITE, and no PUSH_FAIL to the real D
    assert sender.refused == 1
    # The real D's own registration for the transfer still gets P's blocks.
    sender.on_registration(_reg("d-1", "t-1"), agent="D0-tp0")
    sender.poll()
    assert t.writes == [("D0-tp0", [3, 4], [7, 8])]


def test_p_writes_for_the_rightful_registration_held_beside_a_forged_one():
    sender, t, peers = _sender()
    sender.on_registration(_reg("d-forged", "t-1"), agent="rogue-tp0")
    # the blocks match the forgery first
    sender.on_finished_blocks(FinishedBlocks("p-1", "t-1", [3, 4], 20, DIGEST))
    sender.on_registration(_reg("d-real", "t-1"), agent="D0-tp0")
    peers.finish(D_ADDR, "D0-tp0")
    sender.poll()  # drops the forgery, matches the blocks with the real registration ...
    sender.poll()  # ... and posts it on the writer's next pass
    assert t.writes == [("D0-tp0", [3, 4], [7, 8])] and sender.refused == 1


def test_p_drops_an_answer_for_an_address_that_serves_another_agent():
    sender, t, peers = _sender()
    sender.on_aborted("p-1", "t-1")  # P gave up on t-1: a registration for it gets PUSH_FAIL
    sender.on_registration(_reg("d-1", "t-1"), agent="rogue-tp0")
    peers.finish(D_ADDR, "D0-tp0")
    sender.poll()
    assert t.sent == [] and sender.refused == 1


def test_p_acts_on_heartbeats_and_cancels_only_from_the_registering_agent():
    sender, t, peers = _sender()
    peers.finish(D_ADDR, "D0-tp0")
    sender.on_registration(_reg("d-1", "t-1"), agent="D0-tp0")
    sender.on_heartbeat(["t-1"], agent="rogue-tp0")
    sender.on_cancel("d-1", "t-1", agent="rogue-tp0")
    sender.on_registration(_reg("d-1", "t-2"), agent="rogue-tp0")  # same D id, another agent
    assert sender.refused == 3 and sender.regs[("d-1", 0)].agent == "D0-tp0"
    assert not sender.tombstones
    sender.on_cancel("d-1", "t-1", agent="D0-tp0")
    assert ("d-1", 0) not in sender.regs
    assert [wire.notif_kind(m) for _, m in t.sent] == ["PUSH_CANCEL_ACK"]


def test_d_acts_on_p_notifications_only_from_the_agent_loaded_for_that_p():
    t, peers = FakeTransport(), Peers()
    peers.finish(P_ADDR, "P0-tp0")
    identity = {"decode_engine_id": "D0", "decode_host": D_ADDR[0],
                "decode_port": D_ADDR[1], "decode_tp_size": 1}
    r = Receiver(t, peers, lambda: 100.0, identity=identity, ttl=10.0, hb_interval=1.0,
                 grace=1.0,
                 stats={"kv_push_registrations_sent_total": 0})
    r.on_registration(Registration("d-1", "t-1", [7, 8], 0, 20, "P0", *P_ADDR, 1))
    r.poll()
    assert "d-1" in r.waiting
    r.on_completion("d-1", agent="rogue-tp0")
    r.on_push_fail("d-1", "rogue", agent="rogue-tp0")
    assert r.refused == 2 and "d-1" in r.waiting and not r.failed_recving
    r.on_released("d-1")  # the client went away: quarantined until P acknowledges
    r.on_cancel_ack("d-1", agent="rogue-tp0")
    assert r.refused == 3 and "d-1" in r.quarantine
    r.on_cancel_ack("d-1", agent="P0-tp0")
    assert r.done == {"d-1"}
