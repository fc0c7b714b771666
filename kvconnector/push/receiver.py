"""D side of the push thread: register preallocated blocks with P, await the WRITE.

Owned by the push thread. A request's blocks become free-able (`done`) only once it is
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

Tensor parallelism (docs/design.md §8): this rank's heads come from every P rank holding some
of them (`tp_layout.peer_ranks`: one when P is the same size or smaller, k when P is k times
bigger), each at P rank p's side channel (`side_channel_port(kv_port, 0, p, …)`). A request
has one `Recv` per such P rank (a "part", keyed by (request id, P rank)), each its own
machine: its own PUSH_REG, heartbeats, watchdog, cancel and ack. Towards the scheduler they
are one request, as `KVOutputAggregator` combines ranks: the KV has landed when every part's
WRITE completed; the first failure of any part fails the request (once); its blocks are freed
once every part is SAFE and the request released.
"""

from __future__ import annotations

import enum
import logging
import queue
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.connector_seam import SeededToken
from kvconnector import wire
from kvconnector.endpoint import side_channel_port
from kvconnector.peers import ALIVE, GONE, Address, Peers
from kvconnector.push.meta import Queued, Registration
from kvconnector.seed import from_wire
from kvconnector.tp_layout import peer_ranks

logger = logging.getLogger(__name__)

_PROBE_FAILURES_FOR_DEAD = 2

PartKey = tuple[str, int]  # (D request id, P's TP rank the part's heads come from)


class RecvState(enum.Enum):
    """Where one D request stands (docs/design.md §6 draws the machine)."""

    QUEUED = "queued"  # in D's queue, no blocks yet: heartbeat P only
    UNSENT = "unsent"  # blocks registered, PUSH_REG waits for the handshake with P
    WAITING = "waiting"  # PUSH_REG sent, no completion yet: a WRITE may land
    QUARANTINED = "quarantined"  # cancelled, unacknowledged: a WRITE may land until `deadline`
    SAFE = "safe"  # no WRITE can land any more; the blocks wait for the scheduler's release


@dataclass
class Recv:
    """One D request's state; `released`: the scheduler is done with it. SAFE and released
    is the end: the entry goes and the id is reported in `done` (its blocks may be freed)."""

    state: RecvState
    addr: Address  # P's side channel
    hb_id: str  # what heartbeats name it by
    transfer_id: str = ""  # "" = none (P matches by request id)
    reg: Registration | None = None  # from UNSENT on
    sent_at: float = 0.0  # WAITING: when the PUSH_REG left
    deadline: float = 0.0  # QUARANTINED: when nothing can land any more
    released: bool = False
    landed: bool = False  # SAFE because its WRITE completed
    told: bool = False  # its failure was reported to the scheduler


class Receiver:
    def __init__(self, transport: Any, peers: Peers, clock: Callable[[], float], *,
                 identity: dict[str, Any], ttl: float, hb_interval: float, grace: float,
                 stats: dict[str, float], tp_rank: int = 0, tp_size: int = 1) -> None:
        self.t = transport
        self.peers = peers
        self.clock = clock
        self.identity = identity  # decode_engine_id, decode_host, decode_port, tp size, rank
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.ttl = ttl
        self.hb_interval = hb_interval
        self.grace = grace
        self.stats = stats
        self.requests: dict[PartKey, Recv] = {}  # every part not done yet
        self._count: Counter[RecvState] = Counter()  # requests per state (an index)
        self._p_ranks: set[int] = set()  # P ranks any part named (an index for `_parts`)
        # Outputs, drained by the transfer thread each step:
        self.finished_recving: set[str] = set()
        self.failed_recving: dict[str, str] = {}
        self.seeded: dict[str, SeededToken] = {}  # P's first token, with a receipt
        self.done: set[str] = set()
        self._next_hb = 0.0
        self._probe_failures: dict[Address, int] = {}
        self.probe_results: queue.SimpleQueue[tuple[Address, str, str | None]] = (
            queue.SimpleQueue())
        self.refused = 0  # notifications from an agent other than the request's P

    # --- the state table ----------------------------------------------------------
    def _enter(self, rid: PartKey, r: Recv) -> None:
        old = self.requests.get(rid)
        if old is not None:
            self._count[old.state] -= 1
            r.released = old.released
        self.requests[rid] = r
        self._count[r.state] += 1

    def _move(self, rid: PartKey, state: RecvState) -> Recv:
        r = self.requests[rid]
        self._count[r.state] -= 1
        self._count[state] += 1
        r.state = state
        return r

    def _in(self, state: RecvState) -> dict[PartKey, Recv]:
        """The requests in `state` (a view built on demand)."""
        if not self._count[state]:
            return {}
        return {rid: r for rid, r in self.requests.items() if r.state is state}

    def _state(self, key: PartKey | None) -> RecvState | None:
        r = self.requests.get(key) if key is not None else None
        return None if r is None else r.state

    def _parts(self, rid: str) -> list[PartKey]:
        """The parts of request `rid` not done yet (O(P ranks), not O(requests))."""
        return [(rid, p) for p in sorted(self._p_ranks) if (rid, p) in self.requests]

    def _p_parts(self, rid: str, host: str, port: int, remote_tp_size: int
                 ) -> list[tuple[PartKey, tuple[str, int]]]:
        """(part, P rank's side channel) for each P rank holding heads of this rank."""
        ranks = peer_ranks(self.tp_rank, self.tp_size, remote_tp_size)
        self._p_ranks.update(ranks)
        return [((rid, p), (host, side_channel_port(port, 0, p, remote_tp_size)))
                for p in ranks]

    @property
    def waiting(self) -> set[str]:
        """Requests with a part waiting for its WRITE (a view)."""
        return {k[0] for k in self._in(RecvState.WAITING)}

    @property
    def quarantine(self) -> set[str]:
        """Requests with a part quarantined (a view)."""
        return {k[0] for k in self._in(RecvState.QUARANTINED)}

    # --- events from the scheduler ------------------------------------------------
    def on_queued(self, q: Queued) -> None:
        for key, addr in self._p_parts(q.request_id, q.remote_host, q.remote_port,
                                       q.remote_tp_size):
            self._enter(key, Recv(RecvState.QUEUED, addr, q.hb_id, q.transfer_id))
            self.peers.get(addr, key[1])  # handshake while D queues

    def on_registration(self, reg: Registration) -> None:
        for key, addr in self._p_parts(reg.request_id, reg.remote_host, reg.remote_port,
                                       reg.remote_tp_size):
            self._enter(key, Recv(RecvState.UNSENT, addr, reg.hb_id, reg.transfer_id, reg))
            self.peers.get(addr, key[1])

    def on_watchdog(self, rid: str) -> None:
        for key in self._parts(rid):
            state = self._state(key)
            if state is RecvState.UNSENT:
                self._fail(key, "registration never reached P before the watchdog")
            elif state is RecvState.WAITING:
                self._cancel(key, "no KV from P within push_registration_timeout")

    def on_released(self, rid: str) -> None:
        keys = self._parts(rid)
        if not keys:  # never registered, or its transfer is long over
            self.done.add(rid)
            return
        for key in keys:
            r = self.requests[key]
            r.released = True
            if r.state in (RecvState.QUEUED, RecvState.UNSENT):
                self._move(key, RecvState.SAFE)  # no PUSH_REG left D: nothing can land
                self._cancel_unregistered(key)
            elif r.state is RecvState.WAITING:
                self._cancel(key, None)
            self._settle(key)

    # --- events from P ------------------------------------------------------------
    def on_completion(self, rid: str, agent: str | None = None,
                      first_token: wire.FirstToken | None = None) -> None:
        key = self._from_p(rid, agent, "completion")
        if key is False:
            return
        state = self._state(key)
        if state is RecvState.WAITING:
            r = self._move(key, RecvState.SAFE)
            r.landed = True
            if first_token is not None and r.reg is not None and r.reg.first_token:
                self.seeded[rid] = from_wire(first_token)  # type: ignore[assignment]
            parts = [self.requests[k] for k in self._parts(rid)]
            if all(p.landed for p in parts):  # WAITING is never released (that cancels)
                self.finished_recving.add(rid)
        elif state is RecvState.QUARANTINED:
            logger.info("WRITE for cancelled %s completed before the cancel reached P", rid)
            self._move(key, RecvState.SAFE)
        else:
            logger.warning("completion for unknown request %s dropped", rid)
            return
        self._settle(key)

    def on_push_fail(self, rid: str, reason: str, agent: str | None = None) -> None:
        key = self._from_p(rid, agent, "PUSH_FAIL")
        if key is False:
            return
        state = self._state(key)
        if state is RecvState.WAITING:
            self._tell(key, f"prefill engine will not write: {reason}")
        elif state is not RecvState.QUARANTINED:  # cancelled: its failure is already told
            logger.warning("PUSH_FAIL for unknown request %s dropped", rid)
            return
        self._move(key, RecvState.SAFE)
        self._settle(key)

    def on_cancel_ack(self, rid: str, agent: str | None = None) -> None:
        key = self._from_p(rid, agent, "PUSH_CANCEL_ACK")
        if key is not False and self._state(key) is RecvState.QUARANTINED:
            acks = "kv_push_cancel_acks_received_total"
            self.stats[acks] = self.stats.get(acks, 0) + 1
            self._move(key, RecvState.SAFE)
            self._settle(key)

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
        for rid, r in self._in(RecvState.QUARANTINED).items():
            if now >= r.deadline:
                logger.warning("no cancel ack for %s by its deadline; P can no longer write",
                               rid)
                self._move(rid, RecvState.SAFE)
                self._settle(rid)
        if now >= self._next_hb:
            self._next_hb = now + self.hb_interval
            self._heartbeat()

    def needs_poll(self) -> bool:
        """Poll while a WRITE may be landing (the target must progress too)."""
        return bool(self._count[RecvState.WAITING] or self._count[RecvState.UNSENT])

    def next_deadline(self) -> float | None:
        times = [r.deadline for r in self._in(RecvState.QUARANTINED).values()]
        if (self._count[RecvState.QUEUED] or self._count[RecvState.QUARANTINED]
                or self.peers.failed_with_agent()):
            times.append(self._next_hb)  # heartbeats and liveness probes
        return min(times) if times else None

    # --- internals ----------------------------------------------------------------
    def _from_p(self, rid: str, agent: str | None, what: str) -> PartKey | None | bool:
        """The part of `rid` whose P address has `agent` loaded; False (refused) when `agent`
        is none of them while a part waits or is quarantined. A request D does not wait for
        is left to the caller's own 'unknown' handling (None, or a part not waiting)."""
        keys = self._parts(rid)
        if not keys:
            return None
        if agent is None:
            return keys[0]
        for key in keys:
            if self.peers.known_agent(self.requests[key].addr) == agent:
                return key
        exposed = [k for k in keys
                   if self.requests[k].state in (RecvState.WAITING, RecvState.QUARANTINED)]
        if not exposed:
            return keys[0]
        self.refused += 1
        r = self.requests[exposed[0]]
        logger.warning("refused %s for %s from agent %s: the request's P at %s:%d is agent %s",
                       what, rid, agent, *r.addr, self.peers.known_agent(r.addr))
        return False

    def _drain_probes(self) -> list[tuple[Address, str, str | None]]:
        out = []
        while not self.probe_results.empty():
            out.append(self.probe_results.get_nowait())
        return out

    def _send_unsent(self, now: float) -> None:
        for key, r in self._in(RecvState.UNSENT).items():
            rid, reg, addr = key[0], r.reg, r.addr
            assert reg is not None
            peer = self.peers.get(addr)
            if peer.status == "pending":
                continue
            if peer.status == "failed":
                self._fail(key, f"handshake with prefill engine {reg.remote_engine_id} at "
                                f"{addr[0]}:{addr[1]} failed: {peer.reason}")
                continue
            try:
                msg = wire.encode_push_reg(wire.PushReg(
                    request_id=rid, transfer_id=reg.transfer_id,
                    local_block_ids=[list(reg.local_block_ids)],
                    first_block_index=reg.first_block_index,
                    remote_engine_id=reg.remote_engine_id, remote_host=reg.remote_host,
                    remote_port=addr[1], remote_tp_size=reg.remote_tp_size,
                    prompt_digest=reg.prompt_digest, first_token=reg.first_token,
                    **self.identity,
                ))
                self.t.send_notif(peer.agent_name, msg)
            except Exception as e:  # noqa: BLE001
                self._fail(key, f"sending PUSH_REG to {addr[0]}:{addr[1]} failed: {e}")
                continue
            self.stats["kv_push_registrations_sent_total"] += 1
            self._move(key, RecvState.WAITING).sent_at = now

    def _tell(self, key: PartKey, reason: str) -> None:
        """Report the request failed to the scheduler, once whichever part fails first, and
        never after its release (the scheduler half counts `kv_recv_failed_total`)."""
        parts = [self.requests[k] for k in self._parts(key[0])]
        if any(p.told or p.released for p in parts):
            return
        self.requests[key].told = True
        self.failed_recving[key[0]] = reason

    def _cancel(self, key: PartKey, failure: str | None) -> None:
        """WAITING → QUARANTINED: tell P to stop; its WRITE may land until the deadline."""
        rid = key[0]
        r = self._move(key, RecvState.QUARANTINED)
        r.deadline = r.sent_at + 2 * self.ttl + self.grace
        if failure:
            self._tell(key, failure)
        # Also to a peer declared dead: one that was only frozen or cut off gets the cancel
        # right after our PUSH_REG (same agent pair, in order) and never writes; the
        # quarantine deadline alone would not hold against a P that wakes up late.
        agent = self.peers.known_agent(r.addr)
        if agent is not None:
            assert r.reg is not None
            try:
                self.t.send_notif(agent, wire.encode_push_cancel(rid, r.reg.transfer_id))
            except Exception as e:  # noqa: BLE001 - the deadline still bounds the quarantine
                logger.warning("PUSH_CANCEL for %s to %s:%d failed: %s", rid, *r.addr, e)

    def _cancel_unregistered(self, key: PartKey) -> None:
        """The request left D before its PUSH_REG did: P may hold its prefilled blocks under
        lease for it. A PUSH_CANCEL (P acknowledges it, but nothing here waits for that)
        frees them now, and P frees blocks it prefills later for this transfer at once."""
        r = self.requests[key]
        agent = self.peers.known_agent(r.addr)
        if agent is None:
            return  # no handshake with P yet: the lease frees P's blocks
        try:
            self.t.send_notif(agent, wire.encode_push_cancel(key[0], r.transfer_id))
        except Exception as e:  # noqa: BLE001 - P's lease still frees them
            logger.warning("PUSH_CANCEL for unregistered %s to %s:%d failed: %s", key[0],
                           *r.addr, e)

    def _fail(self, key: PartKey, reason: str) -> None:
        """A part nothing can land in any more will not get its KV (→ SAFE)."""
        logger.warning("receiving KV for %s (from P rank %d) failed: %s", *key, reason)
        self._tell(key, reason)
        self._move(key, RecvState.SAFE)
        self._settle(key)

    def _settle(self, key: PartKey) -> None:
        """A SAFE, released part is over; the request's blocks go with its last part."""
        r = self.requests[key]
        if r.state is RecvState.SAFE and r.released:
            del self.requests[key]
            self._count[RecvState.SAFE] -= 1
            if not self._parts(key[0]):
                self.done.add(key[0])

    def _heartbeat(self) -> None:
        by_peer: dict[Address, list[str]] = {}
        watched: set[Address] = set()
        for r in self.requests.values():
            if r.state in (RecvState.QUEUED, RecvState.WAITING):
                by_peer.setdefault(r.addr, []).append(r.hb_id)
            if r.state in (RecvState.WAITING, RecvState.QUARANTINED):
                watched.add(r.addr)
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
        watched |= set(self.peers.failed_with_agent())
        for addr in watched:
            self.peers.probe(addr, lambda a, v, ag: self.probe_results.put((a, v, ag)))

    def _at(self, addr: Address, *states: RecvState) -> list[PartKey]:
        return [rid for rid, r in self.requests.items() if r.addr == addr and r.state in states]

    def _peer_dead(self, addr: Address) -> None:
        self._probe_failures.pop(addr, None)
        self.peers.mark_failed(addr, "not answering")
        where = f"{addr[0]}:{addr[1]}"
        for rid in self._at(addr, RecvState.WAITING):
            reg = self.requests[rid].reg
            assert reg is not None
            self._cancel(rid, f"prefill engine {reg.remote_engine_id} at {where} is "
                              "unreachable")
        for rid in self._at(addr, RecvState.UNSENT):  # nothing left D: nothing can land
            self._fail(rid, f"prefill engine at {where} is unreachable")

    def _peer_gone(self, addr: Address) -> None:
        """P's process at `addr` no longer exists: nothing it held can be written any more."""
        self._probe_failures.pop(addr, None)
        self.stats["kv_peer_gone_total"] = self.stats.get("kv_peer_gone_total", 0) + 1
        where = f"{addr[0]}:{addr[1]}"
        logger.warning("prefill engine at %s is gone (process exited or restarted): freeing "
                       "its quarantined blocks", where)
        for rid in self._at(addr, RecvState.WAITING, RecvState.UNSENT, RecvState.QUARANTINED):
            r = self.requests[rid]
            if r.state is RecvState.QUARANTINED:
                self._move(rid, RecvState.SAFE)
                self._settle(rid)
            elif r.state is RecvState.WAITING:
                assert r.reg is not None
                self._fail(rid, f"prefill engine {r.reg.remote_engine_id} at {where} is gone")
            else:
                self._fail(rid, f"prefill engine at {where} is gone")
        self.peers.forget(addr)

    def addresses_in_use(self) -> set[Address]:
        """P addresses a request still needs (never pruned as idle)."""
        return {r.addr for r in self.requests.values() if r.state is not RecvState.SAFE}

    def table_sizes(self) -> dict[str, int]:
        c = self._count
        return {"d_queued": c[RecvState.QUEUED], "d_unsent": c[RecvState.UNSENT],
                "d_waiting": c[RecvState.WAITING], "d_quarantine": c[RecvState.QUARANTINED],
                "d_safe": c[RecvState.SAFE],
                "d_released": sum(r.released for r in self.requests.values())}
