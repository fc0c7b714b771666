"""Stray registrations and early cancels, with plain data (a fake transport and clock).

- P holds a registration for its ttl only while one of its requests (arrived in its
  scheduler, prefilling, or staged) carries the transfer; otherwise it answers PUSH_FAIL
  `unknown_timeout` after the registration arrived (`kv_push_unknown_transfer_total`);
- a cancel frees blocks staged for the transfer that no registration matched, at once, but
  never blocks paired with another agent's registration;
- D sends PUSH_CANCEL for a request that leaves while queued, so P frees its blocks;
- the writer applies `arrived` before the same step's `finished_blocks`.
"""

from __future__ import annotations

import threading

from push_fakes import Clock, FakeTransport
from test_push_fault_units import (
    D_AGENT,
    LEASE,
    LOADED,
    TTL,
    FakePeers,
    _blocks,
    _d_receiver,
    _reg,
)

from kvconnector import wire
from kvconnector.push.meta import PushMeta, Queued
from kvconnector.push.receiver import Receiver
from kvconnector.push.sender import Sender, SenderStats
from kvconnector.push.thread import PushThread

UNKNOWN_S = 2.0
UNKNOWN = "kv_push_unknown_transfer_total"


def _writer(clock: Clock, loaded: tuple[str, ...] = LOADED
            ) -> tuple[PushThread, FakeTransport, Sender]:
    t, peers = FakeTransport(loaded), FakePeers(D_AGENT)
    sender = Sender(t, peers, clock, lease=LEASE, ttl=TTL, tp_size=1, bytes_per_block=64,
                    stats=SenderStats(), unknown_timeout=UNKNOWN_S)
    receiver = Receiver(t, peers, clock, identity={}, ttl=TTL, hb_interval=1.0, grace=1.0,
                        stats={"kv_push_registrations_sent_total": 0})
    return PushThread(t, peers, sender, receiver, threading.Event(), clock), t, sender


def _arrived(pid: str, tid: str | None) -> PushMeta:
    return PushMeta(arrived=[(pid, tid)])


def _fails(t: FakeTransport) -> list[wire.PushFail]:
    return [wire.decode_notif(m) for _, m in t.sent if m.startswith(b"PUSH_FAIL:")]


def test_a_registration_no_request_carries_is_refused_after_the_unknown_timeout():
    clock = Clock()
    writer, t, sender = _writer(clock)
    t.inbox.append((D_AGENT, _reg("d-1", "made-up")))
    writer.step()
    assert sender.next_deadline() == clock.t + UNKNOWN_S
    clock.t += UNKNOWN_S - 0.01
    writer.step()
    assert t.kinds() == [] and sender.regs  # within the grace: P's leg may still come
    clock.t += 0.02
    writer.step()
    [fail] = _fails(t)
    assert (fail.request_id, fail.transfer_id) == ("d-1", "made-up")
    assert fail.reason.startswith("unknown transfer")
    assert sender.stats.counters[UNKNOWN] == 1 and not sender.regs
    assert sender.next_deadline() is None


def test_a_registration_whose_p_leg_arrives_within_the_grace_waits_and_is_written():
    clock = Clock()
    writer, t, sender = _writer(clock)
    t.inbox.append((D_AGENT, _reg("d-1", "t-1")))
    writer.step()
    clock.t += UNKNOWN_S / 2
    writer.inbox.put(_arrived("p-1", "t-1"))  # P's leg reached P's scheduler
    writer.step()
    clock.t += UNKNOWN_S  # the grace is over; P is still prefilling: the ttl holds it
    writer.step()
    assert t.kinds() == [] and sender.regs and sender.next_deadline() is None
    writer.inbox.put(_blocks("p-1", "t-1"))
    writer.step()
    assert t.writes == [(D_AGENT, [3, 4], [7, 8])]
    assert sender.stats.counters[UNKNOWN] == 0
    assert sender.table_sizes()["p_prefilling"] == 0


def test_a_registration_for_a_prefilling_or_staged_transfer_is_never_checked():
    clock = Clock()
    writer, t, sender = _writer(clock)
    writer.inbox.put(_arrived("p-1", "t-1"))
    writer.step()
    t.inbox.append((D_AGENT, _reg("d-1", "t-1")))
    writer.step()
    assert sender.next_deadline() is None
    # without a transfer id the transfer is the base request id (vLLM's push protocol)
    writer.inbox.put(_arrived("req-7-0123abcd", None))
    writer.step()
    t.inbox.append((D_AGENT, _reg("req-7-89abcdef", "")))
    writer.step()
    assert sender.next_deadline() is None
    clock.t += 2 * UNKNOWN_S
    writer.step()
    assert _fails(t) == []


def test_an_aborted_p_request_no_longer_carries_its_transfer():
    clock = Clock()
    writer, t, sender = _writer(clock)
    writer.inbox.put(PushMeta(arrived=[("p-1", "t-1")], aborted=[("p-1", "t-1")]))
    writer.step()  # arrived first, then ended, in one step
    assert sender.table_sizes()["p_prefilling"] == 0
    t.inbox.append((D_AGENT, _reg("d-1", "t-2")))
    writer.step()
    clock.t += UNKNOWN_S + 0.01
    writer.step()
    assert [f.transfer_id for f in _fails(t)] == ["t-2"]


def test_a_cancel_frees_blocks_staged_for_the_transfer_at_once():
    clock = Clock()
    writer, t, sender = _writer(clock)
    writer.inbox.put(_blocks("p-1", "t-1"))
    writer.step()
    assert sender.staged
    # D's PUSH_REG never arrived (lost, or D's request left while queued): D cancels
    t.inbox.append((D_AGENT, wire.encode_push_cancel("d-1", "t-1")))
    writer.step()
    assert writer.collect().finished_sending == {"p-1"}
    assert not sender.staged and sender.stats.counters["kv_lease_expired_total"] == 0


def test_a_strangers_cancel_does_not_free_blocks_matched_to_another_agent():
    clock = Clock()
    writer, t, sender = _writer(clock)
    sender.peers.state.status = "pending"  # D's reverse handshake not done: MATCHED waits
    writer.inbox.put(_blocks("p-1", "t-1"))
    t.inbox.append((D_AGENT, _reg("d-1", "t-1")))
    writer.step()
    assert sender.ready == [("p-1", ("d-1", 0))]
    t.inbox.append(("rogue-tp0", wire.encode_push_cancel("other", "t-1")))
    writer.step()
    assert sender.staged and sender.ready == [("p-1", ("d-1", 0))]
    assert not writer.collect().finished_sending


def test_d_cancels_at_p_when_a_queued_request_leaves():
    clock, t, peers = Clock(), FakeTransport(LOADED), FakePeers("P0-tp0")
    r = _d_receiver(clock, t, peers)
    r.on_queued(Queued("d-1", "t-1", "P0", "127.0.0.1", 7001))
    r.on_released("d-1")
    assert t.sent == [("P0-tp0", wire.encode_push_cancel("d-1", "t-1"))]
    assert r.done == {"d-1"} and not r.requests


def test_d_sends_nothing_for_a_queued_request_when_p_was_never_reached():
    clock, t, peers = Clock(), FakeTransport(LOADED), FakePeers("P0-tp0")
    peers.known_agent = lambda addr: None  # the handshake with P has not finished
    r = _d_receiver(clock, t, peers)
    r.on_queued(Queued("d-1", "t-1", "P0", "127.0.0.1", 7001))
    r.on_released("d-1")
    assert t.sent == [] and r.done == {"d-1"}


def test_the_unknown_timeout_wakes_an_idle_writer():
    clock = Clock()
    writer, t, sender = _writer(clock)
    t.inbox.append((D_AGENT, _reg("d-1", "made-up")))
    writer.step()
    assert writer._timeout() == 1.0  # nothing else to do: the idle tick
    clock.t += UNKNOWN_S - 0.5
    assert abs(writer._timeout() - 0.5) < 1e-9  # sleeps until the check, not a whole tick

