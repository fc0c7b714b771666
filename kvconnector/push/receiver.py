"""D side of the push writer: register preallocated blocks with P, await the WRITE.

Owned by the writer thread. A request's blocks become free-able (`done`) only once it is
released by the scheduler AND no WRITE from P can still land in them ("safe"): the WRITE
completed, P said PUSH_FAIL, P acknowledged our PUSH_CANCEL, the registration never left
D, the quarantine deadline passed (P never posts for a registration older than its
ttl, so after `2 * ttl + grace` since sending nothing can land), or P's process is gone.

P's liveness: every heartbeat interval D probes each P it waits for or quarantines for
(and each P it marked failed, to take it back). Two probes without an answer declare P
dead: its waiting requests fail over to recompute and are cancelled (a frozen P may still
wake, so their blocks stay quarantined). A probe that proves the process gone (its side
channel refuses connections, or a different agent answers there: P restarted) frees every
block P could have written at once: a process that no longer exists writes nothing. A
failed P that answers a probe again is taken back, so D resumes receiving KV at once.

A completion, PUSH_FAIL or PUSH_CANCEL_ACK acts on a request only when it comes from the
NIXL agent D's handshake loaded for that request's P address; from any other agent it is
refused (counted in `refused`, logged, dropped).
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvconnector import wire
from kvconnector.peers import ALIVE, GONE, Address, Peers
from kvconnector.push.meta import Queued, Registration

logger = logging.getLogger(__name__)

_PROBE_FAILURES_FOR_DEAD = 2


@dataclass
class Waiting:
    reg: Registration
    sent_at: float

    @property
    def addr(self) -> Address:
        return (self.reg.remote_host, self.reg.remote_port)


class Receiver:
    def __init__(self, transport: Any, peers: Peers, clock: Callable[[], float], *,
                 identity: dict[str, Any], ttl: float, hb_interval: float, grace: float,
                 stats: dict[str, float]) -> None:
        self.t = transport
        self.peers = peers
        self.clock = clock
        self.identity = identity  # decode_engine_id, decode_host, decode_port, tp size
        self.ttl = ttl
        self.hb_interval = hb_interval
        self.grace = grace
        self.stats = stats
        self.queued: dict[str, Queued] = {}  # waiting in D's queue: heartbeat only
        self.unsent: dict[str, Registration] = {}  # waiting for the handshake with P
        self.waiting: dict[str, Waiting] = {}  # PUSH_REG sent, no completion yet
        self.quarantine: dict[str, tuple[Address, float]] = {}  # cancelled: unacked until
        self.safe: set[str] = set()  # no WRITE can land any more
        self.released: set[str] = set()  # the scheduler is done with the request
        self.finished_recving: set[str] = set()
        self.failed_recving: dict[str, str] = {}
        self.done: set[str] = set()
        self._next_hb = 0.0
        self._probe_failures: dict[Address, int] = {}
        self.probe_results: queue.SimpleQueue[tuple[Address, str, str | None]] = (
            queue.SimpleQueue())
        self.refused = 0  # notifications from an agent other than the request's P

    # --- events from the scheduler ------------------------------------------------
    def on_queued(self, q: Queued) -> None:
        self.queued[q.request_id] = q
        self.peers.get((q.remote_host, q.remote_port))  # handshake while D queues

    def on_registration(self, reg: Registration) -> None:
        self.queued.pop(reg.request_id, None)
        self.unsent[reg.request_id] = reg

    def on_watchdog(self, rid: str) -> None:
        if rid in self.unsent:
            del self.unsent[rid]
            self._fail(rid, "registration never reached P before the watchdog", safe=True)
        elif rid in self.waiting:
            self._cancel(rid, "no KV from P within push_registration_timeout")

    def on_released(self, rid: str) -> None:
        self.released.add(rid)
        if self.queued.pop(rid, None) is not None or self.unsent.pop(rid, None) is not None:
            self.safe.add(rid)
        elif rid in self.waiting:
            self._cancel(rid, None)
        elif rid not in self.quarantine:
            self.safe.add(rid)
        self._settle(rid)

    # --- events from P ------------------------------------------------------------
    def on_completion(self, rid: str, agent: str | None = None) -> None:
        if not self._from_p(rid, agent, "completion"):
            return
        if self.waiting.pop(rid, None) is not None and rid not in self.released:
            self.finished_recving.add(rid)
        elif self.quarantine.pop(rid, None) is not None:
            logger.info("WRITE for cancelled %s completed before the cancel reached P", rid)
        else:
            logger.warning("completion for unknown request %s dropped", rid)
            return
        self.safe.add(rid)
        self._settle(rid)

    def on_push_fail(self, rid: str, reason: str, agent: str | None = None) -> None:
        if not self._from_p(rid, agent, "PUSH_FAIL"):
            return
        known = self.waiting.pop(rid, None) or self.quarantine.pop(rid, None)
        if known is None:
            logger.warning("PUSH_FAIL for unknown request %s dropped", rid)
            return
        if rid not in self.released and not isinstance(known, tuple):
            self.failed_recving[rid] = f"prefill engine will not write: {reason}"
        self.safe.add(rid)
        self._settle(rid)

    def on_cancel_ack(self, rid: str, agent: str | None = None) -> None:
        if not self._from_p(rid, agent, "PUSH_CANCEL_ACK"):
            return
        if self.quarantine.pop(rid, None) is not None:
            self.safe.add(rid)
            self._settle(rid)

    def on_probe(self, addr: Address, verdict: str, agent: str | None = None) -> None:
        """A liveness probe of P at `addr` (which had `agent` loaded) ended with `verdict`."""
        if agent is not None and agent != self.peers.known_agent(addr):
            return  # about an agent we no longer use (P was re-handshaked meanwhile)
        if verdict == ALIVE:
            self._probe_failures.pop(addr, None)
            self.peers.revive(addr)
            return
        if verdict == GONE:
            self._peer_gone(addr)
            return
        n = self._probe_failures.get(addr, 0) + 1
        self._probe_failures[addr] = n
        if n >= _PROBE_FAILURES_FOR_DEAD:
            self._peer_dead(addr)

    # --- the poll -----------------------------------------------------------------
    def poll(self) -> None:
        now = self.clock()
        for addr, verdict, agent in self._drain_probes():
            self.on_probe(addr, verdict, agent)
        self._send_unsent(now)
        for rid, (_, deadline) in list(self.quarantine.items()):
            if now >= deadline:
                logger.warning("no cancel ack for %s by its deadline; P can no longer write",
                               rid)
                del self.quarantine[rid]
                self.safe.add(rid)
                self._settle(rid)
        if now >= self._next_hb:
            self._next_hb = now + self.hb_interval
            self._heartbeat()

    def needs_poll(self) -> bool:
        """Poll while a WRITE may be landing (the target must progress too)."""
        return bool(self.waiting or self.unsent)

    def next_deadline(self) -> float | None:
        times = [d for _, d in self.quarantine.values()]
        if self.queued or self.quarantine or self.peers.failed_with_agent():
            times.append(self._next_hb)  # heartbeats and liveness probes
        return min(times) if times else None

    # --- internals ----------------------------------------------------------------
    def _from_p(self, rid: str, agent: str | None, what: str) -> bool:
        """Whether `agent` is the P agent loaded for this request's P address (a request D
        does not wait for is left to the caller's own 'unknown' handling)."""
        w = self.waiting.get(rid)
        addr = w.addr if w is not None else self.quarantine.get(rid, (None,))[0]
        if agent is None or addr is None:
            return True
        expected = self.peers.known_agent(addr)
        if agent == expected:
            return True
        self.refused += 1
        logger.warning("refused %s for %s from agent %s: the request's P at %s:%d is agent %s",
                       what, rid, agent, *addr, expected)
        return False

    def _drain_probes(self) -> list[tuple[Address, str, str | None]]:
        out = []
        while not self.probe_results.empty():
            out.append(self.probe_results.get_nowait())
        return out

    def _send_unsent(self, now: float) -> None:
        for rid, reg in list(self.unsent.items()):
            addr = (reg.remote_host, reg.remote_port)
            peer = self.peers.get(addr)
            if peer.status == "pending":
                continue
            del self.unsent[rid]
            if peer.status == "failed":
                self._fail(rid, f"handshake with prefill engine {reg.remote_engine_id} at "
                                f"{addr[0]}:{addr[1]} failed: {peer.reason}", safe=True)
                continue
            try:
                msg = wire.encode_push_reg(wire.PushReg(
                    request_id=rid, transfer_id=reg.transfer_id,
                    local_block_ids=[list(reg.local_block_ids)],
                    first_block_index=reg.first_block_index,
                    remote_engine_id=reg.remote_engine_id, remote_host=reg.remote_host,
                    remote_port=reg.remote_port, remote_tp_size=reg.remote_tp_size,
                    prompt_digest=reg.prompt_digest, **self.identity,
                ))
                self.t.send_notif(peer.agent_name, msg)
            except Exception as e:  # noqa: BLE001
                self._fail(rid, f"sending PUSH_REG to {addr[0]}:{addr[1]} failed: {e}",
                           safe=True)
                continue
            self.stats["kv_push_registrations_sent_total"] += 1
            self.waiting[rid] = Waiting(reg, now)

    def _cancel(self, rid: str, failure: str | None) -> None:
        w = self.waiting.pop(rid)
        deadline = w.sent_at + 2 * self.ttl + self.grace
        self.quarantine[rid] = (w.addr, deadline)
        if failure and rid not in self.released:
            self.failed_recving[rid] = failure
            self.stats["kv_recv_failed_total"] += 1
        # Also to a peer declared dead: one that was only frozen or cut off gets the cancel
        # right after our PUSH_REG (same agent pair, in order) and never writes; the
        # quarantine deadline alone would not hold against a P that wakes up late.
        agent = self.peers.known_agent(w.addr)
        if agent is not None:
            try:
                self.t.send_notif(agent, wire.encode_push_cancel(rid, w.reg.transfer_id))
            except Exception as e:  # noqa: BLE001 - the deadline still bounds the quarantine
                logger.warning("PUSH_CANCEL for %s to %s:%d failed: %s", rid, *w.addr, e)

    def _fail(self, rid: str, reason: str, safe: bool) -> None:
        logger.warning("receiving KV for %s failed: %s", rid, reason)
        if rid not in self.released:
            self.failed_recving[rid] = reason
            self.stats["kv_recv_failed_total"] += 1
        if safe:
            self.safe.add(rid)
            self._settle(rid)

    def _settle(self, rid: str) -> None:
        if rid in self.safe and rid in self.released:
            self.safe.discard(rid)
            self.released.discard(rid)
            self.done.add(rid)

    def _heartbeat(self) -> None:
        by_peer: dict[Address, list[str]] = {}
        for q in self.queued.values():
            by_peer.setdefault((q.remote_host, q.remote_port), []).append(q.hb_id)
        for w in self.waiting.values():
            by_peer.setdefault(w.addr, []).append(w.reg.hb_id)
        for addr, ids in by_peer.items():
            peer = self.peers.get(addr)
            # An id a heartbeat cannot carry (a request id with ',') is not heartbeated: at
            # worst P's lease expires and it answers PUSH_FAIL; D recomputes.
            ids = [i for i in ids if wire.heartbeat_can_carry(i)]
            if peer.status == "ready" and ids:
                try:
                    self.t.send_notif(peer.agent_name, wire.encode_heartbeat(ids))
                except Exception as e:  # noqa: BLE001 - the probe below tells what it means
                    logger.warning("heartbeat to %s:%d failed: %s", *addr, e)
        watched = {w.addr for w in self.waiting.values()}
        watched |= {a for a, _ in self.quarantine.values()}
        watched |= set(self.peers.failed_with_agent())
        for addr in watched:
            self.peers.probe(addr, lambda a, v, ag: self.probe_results.put((a, v, ag)))

    def _peer_dead(self, addr: Address) -> None:
        self._probe_failures.pop(addr, None)
        self.peers.mark_failed(addr, "not answering")
        for rid, w in list(self.waiting.items()):
            if w.addr == addr:
                self._cancel(rid, f"prefill engine {w.reg.remote_engine_id} at "
                                  f"{addr[0]}:{addr[1]} is unreachable")
        self._fail_unsent(addr, "is unreachable")

    def _peer_gone(self, addr: Address) -> None:
        """P's process at `addr` no longer exists: nothing it held can be written any more."""
        self._probe_failures.pop(addr, None)
        self.stats["kv_peer_gone_total"] = self.stats.get("kv_peer_gone_total", 0) + 1
        where = f"{addr[0]}:{addr[1]}"
        logger.warning("prefill engine at %s is gone (process exited or restarted): freeing "
                       "its quarantined blocks", where)
        for rid, w in list(self.waiting.items()):
            if w.addr == addr:
                del self.waiting[rid]
                self._fail(rid, f"prefill engine {w.reg.remote_engine_id} at {where} is gone",
                           safe=True)
        self._fail_unsent(addr, "is gone")
        for rid, (qaddr, _) in list(self.quarantine.items()):
            if qaddr == addr:
                del self.quarantine[rid]
                self.safe.add(rid)
                self._settle(rid)
        self.peers.forget(addr)

    def _fail_unsent(self, addr: Address, what: str) -> None:
        """Registrations for P at `addr` that never left D fail over (nothing can land)."""
        for rid, reg in list(self.unsent.items()):
            if (reg.remote_host, reg.remote_port) == addr:
                del self.unsent[rid]
                self._fail(rid, f"prefill engine at {addr[0]}:{addr[1]} {what}", safe=True)

    def addresses_in_use(self) -> set[Address]:
        """P addresses a request still needs (never pruned as idle)."""
        used = {(q.remote_host, q.remote_port) for q in self.queued.values()}
        used |= {(r.remote_host, r.remote_port) for r in self.unsent.values()}
        used |= {w.addr for w in self.waiting.values()}
        used |= {a for a, _ in self.quarantine.values()}
        return used

    def table_sizes(self) -> dict[str, int]:
        return {"d_queued": len(self.queued), "d_unsent": len(self.unsent),
                "d_waiting": len(self.waiting), "d_quarantine": len(self.quarantine),
                "d_safe": len(self.safe), "d_released": len(self.released)}
