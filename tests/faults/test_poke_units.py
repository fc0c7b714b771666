"""D's transfer thread and P's pokes, with plain data (a fake transport and clock).

D waiting for KV polls its agent slowly until P's poke says a WRITE was posted, then fast
until the poked notification arrives. P's single-copy WRITE may complete before the poke's
TCP round, and D polls fast for a moment after its PUSH_REG: the notification then arrives
first. It answers the poke that follows, which then starts no fast polls (it used to leave
the poke awaited: a second of 1 ms polls for a request that had its KV).
"""

from __future__ import annotations

import threading

from push_fakes import Clock, FakeTransport
from test_push_fault_units import LOADED, FakePeers, _d_receiver, _reg

from kvconnector import wire
from kvconnector.push.meta import Registration
from kvconnector.push.sender import Sender, SenderStats
from kvconnector.push.thread import PushThread
from kvconnector.transfer_thread import FAST_AFTER_POKE_S, POLL_INTERVAL_S, WAIT_POLL_S

P_AGENT = "P0-tp0"


def _d_waiting(clock: Clock, n: int) -> tuple[PushThread, FakeTransport]:
    """D's thread with `n` requests registered at P and waiting for their KV."""
    t, peers = FakeTransport(LOADED), FakePeers(P_AGENT)
    receiver = _d_receiver(clock, t, peers)
    sender = Sender(t, peers, clock, lease=30.0, ttl=30.0, tp_size=1, bytes_per_block=64,
                    stats=SenderStats())
    thread = PushThread(t, peers, sender, receiver, threading.Event(), clock)
    for i in range(n):
        receiver.on_registration(Registration(f"d-{i}", f"t-{i}", [i], 0, 10, "P0",
                                              "127.0.0.1", 7001, 1))
    thread.step()
    assert t.kinds() == ["PUSH_REG"] * n and receiver.needs_poll()
    return thread, t


def _arrive(thread: PushThread, t: FakeTransport, *msgs: bytes, agent: str = P_AGENT) -> None:
    t.inbox.extend((agent, m) for m in msgs)
    thread.step()


def test_a_poke_polls_fast_until_its_notification_arrives():
    clock = Clock()
    thread, t = _d_waiting(clock, 2)
    assert thread._timeout() == WAIT_POLL_S
    thread.poke()
    assert thread._timeout() == POLL_INTERVAL_S
    _arrive(thread, t, wire.encode_completion("d-0", 1))
    assert "d-0" in thread.collect().finished_recving
    assert thread._timeout() == WAIT_POLL_S  # d-1 still waits, on the slow poll


def test_a_notification_before_its_poke_answers_it():
    clock = Clock()
    thread, t = _d_waiting(clock, 3)
    _arrive(thread, t, wire.encode_completion("d-0", 1))  # the WRITE beat its poke
    clock.t += 0.01
    thread.poke()  # ... which comes now: nothing is awaited
    assert thread._timeout() == WAIT_POLL_S, "the early completion left its poke awaited"
    thread.poke()  # the next WRITE's poke is awaited as ever
    assert thread._timeout() == POLL_INTERVAL_S
    _arrive(thread, t, wire.encode_push_fail("d-1", "t-1", "gone"))
    assert thread._timeout() == WAIT_POLL_S


def test_only_notifications_p_pokes_for_answer_a_poke():
    """A PUSH_REG (a kv_both engine is P too) or a heartbeat comes unannounced: it answers
    no poke, or the next WRITE's poke would find nothing awaited and D would poll slowly."""
    clock = Clock()
    thread, t = _d_waiting(clock, 2)
    _arrive(thread, t, _reg("x-1", "tx-1"), wire.encode_heartbeat(["t-0"]))
    thread.poke()
    assert thread._timeout() == POLL_INTERVAL_S


def test_a_notification_older_than_a_pokes_window_answers_no_poke():
    """One whose poke was lost does not swallow a later WRITE's poke."""
    clock = Clock()
    thread, t = _d_waiting(clock, 2)
    _arrive(thread, t, wire.encode_completion("d-0", 1))
    clock.t += FAST_AFTER_POKE_S + 0.1
    thread.poke()
    assert thread._timeout() == POLL_INTERVAL_S
