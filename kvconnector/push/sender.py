"""P side of the push thread: match D registrations with finished prefill blocks, WRITE.

Owned by the push thread. Either side of a match may arrive first. A P request and a
registration name the same transfer when both carry a transfer_id and they are equal; a
transfer_id on either side excludes any other match (client-chosen request ids never pair a
request that has one). Only when neither has one: the exact request id, then the id without
its 8-hex engine suffix (vLLM's push protocol). Either way P writes only when the
registration's prompt digest equals that of the prompt P prefilled; otherwise it answers
PUSH_FAIL (D recomputes) and counts `kv_push_digest_mismatch_total`.
Guarantees:
- blocks staged here are reported free-able (`done`) exactly once: after their WRITE
  completed or failed, or at lease expiry (HB from D extends the lease; D names a transfer
  by its transfer_id, or by its base request id when it has none), or at once when they
  arrive for a transfer P already gave up on (its tombstone: D cancelled before the
  prefill ended);
- no WRITE is ever posted for a registration older than `ttl` (measured on P), nor for
  one D cancelled; a cancel is acknowledged only once no WRITE for it can still land;
- whenever P will not write a registration it knows of, it tells D (PUSH_FAIL): any error on
  the send path (encoding the completion, posting the WRITE) is such a refusal, never a
  lost request;
- state created by remote input is bounded: at most `MAX_REGS_PER_AGENT` registrations per
  sending agent and `MAX_REGS` in all, none naming more blocks than P's cache holds, and
  at most `MAX_OUTBOX` notifications waiting for a peer (the oldest are dropped);
- a registration is held for its ttl only if a P request carries its transfer: one that
  none of P's requests (arrived in P's scheduler, prefilling or staged) carries within
  `unknown_timeout` of its arrival gets PUSH_FAIL (`kv_push_unknown_transfer_total`), so a
  client that sends D legs alone, naming this P and made-up transfers, pins D's blocks for
  seconds, not a ttl (the proxy sends both legs at once: P's leg arrives within ms);
- a cancel for a transfer whose blocks are staged but not being written frees them at once
  (the transfer is tombstoned: no later registration could take them).
- with tensor parallelism, a P rank writes its heads into every D rank holding some of them
  (docs/design.md §8): one registration per such D rank (keyed by D request id and D rank),
  one WRITE each, posted as soon as that registration is matched and its D rank reachable,
  without waiting for another D rank's WRITE; the blocks are freed once the last WRITE is
  over, never while one is in flight; when one fails the D ranks not written get PUSH_FAIL;
- a registration belongs to the NIXL agent that sent it: P WRITEs for it, and answers it,
  only to that agent, and only once the reverse handshake with its decode_host:decode_port
  loaded that same agent; HB and PUSH_CANCEL act only on transfers of the agent that sends
  them. Anything else is refused: counted in `refused`, logged, dropped (never a PUSH_FAIL,
  which would reach the real owner of the request id).
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from kvconnector import transfer_hist, wire
from kvconnector.outbox import Outbox
from kvconnector.peers import Peers
from kvconnector.poke import Poker
from kvconnector.push.meta import FinishedBlocks, heartbeat_id
from kvconnector.push.staged import (
    Inflight,
    PendingReg,
    RegKey,
    SenderStats,
    SendState,
    Staged,
    digest_ok,
    match_rank,
    reg_key,
    tomb_key,
)
from kvconnector.tp_layout import peer_ranks

__all__ = ["Sender", "SenderStats", "SendState"]

logger = logging.getLogger(__name__)

MAX_REGS_PER_AGENT = 4096
MAX_REGS = 16384
MAX_OUTBOX = 4096


class Sender:
    def __init__(self, transport: Any, peers: Peers, clock: Callable[[], float], *,
                 lease: float, ttl: float, tp_size: int, bytes_per_block: int,
                 stats: SenderStats, num_blocks: int = 1 << 31, tp_rank: int = 0,
                 unknown_timeout: float | None = None) -> None:
        self.t = transport
        self.peers = peers
        self.clock = clock
        self.lease = lease
        self.ttl = ttl
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.bytes_per_block = bytes_per_block
        self.num_blocks = num_blocks  # P's cache: no registration can name more
        self.stats = stats
        self.unknown_timeout = unknown_timeout  # None: a registration waits for its ttl
        # P requests in P's scheduler not finished yet, by tomb_key (the transfer they carry)
        self.prefilling: Counter[str] = Counter()
        # The P requests, each in one SendState; `ready` and `inflight` are views of it.
        self.staged: dict[str, Staged] = {}  # P request id -> blocks under lease
        self._count: Counter[SendState] = Counter()  # staged requests per state (an index)
        self._seq = itertools.count(1)
        # D's registrations P holds, by D request id, until a WRITE takes one (or it fails):
        # the other side of a match, which may arrive first.
        self.regs: dict[RegKey, PendingReg] = {}
        # Transfers P gave up on (by tomb_key; they outlive the request) -> expiry.
        self.tombstones: dict[str, float] = {}
        self.outbox = Outbox(transport, peers, MAX_OUTBOX,  # notifs waiting for D's peer
                             lambda n: self.stats.add("kv_notifs_dropped_total", n))
        self.done: set[str] = set()  # output: P ids whose blocks may be freed
        self.refused = 0  # notifications refused: not from the agent the transfer belongs to
        self.poker: Poker | None = None  # tells D a WRITE was posted (kvconnector/poke.py)

    # --- the state table ----------------------------------------------------------
    def _move(self, p_id: str, state: SendState) -> Staged:
        s = self.staged[p_id]
        self._count[s.state] -= 1
        self._count[state] += 1
        s.state = state
        return s

    def _sync(self, p_id: str) -> Staged:
        """The state its WRITEs and matches say: WRITING, MATCHED or STAGED."""
        s = self.staged[p_id]
        return self._move(p_id, SendState.WRITING if s.writes else
                          SendState.MATCHED if s.matched else SendState.STAGED)

    def _in(self, state: SendState) -> dict[str, Staged]:
        if not self._count[state]:
            return {}
        return {p: s for p, s in self.staged.items() if s.state is state}

    @property
    def ready(self) -> list[tuple[str, RegKey]]:
        """(P id, D id) matched, the WRITE waiting for D's peer, in match order."""
        matched = [(s.match_seq, p, k) for state in (SendState.MATCHED, SendState.WRITING)
                   for p, s in self._in(state).items() for k in s.matched]
        return [(p, k) for _, p, k in sorted(matched)]

    @property
    def inflight(self) -> list[Inflight]:
        """The posted WRITEs (several per P request when it writes several D ranks)."""
        return [w for s in self._in(SendState.WRITING).values() for w in s.writes.values()]

    # --- events -------------------------------------------------------------------
    def on_arrived(self, request_id: str, transfer_id: str | None) -> None:
        """A P request entered P's scheduler: registrations for its transfer are not strays.
        It ends in `on_finished_blocks` or `on_aborted`."""
        self.prefilling[tomb_key(transfer_id, request_id)] += 1

    def _ended(self, request_id: str, transfer_id: str | None) -> None:
        key = tomb_key(transfer_id, request_id)
        if self.prefilling[key] > 1:
            self.prefilling[key] -= 1
        else:
            self.prefilling.pop(key, None)

    def on_finished_blocks(self, fb: FinishedBlocks) -> None:
        self._ended(fb.request_id, fb.transfer_id)
        old = self.staged.pop(fb.request_id, None)
        if old is not None:
            self._count[old.state] -= 1
        if tomb_key(fb.transfer_id, fb.request_id) in self.tombstones:
            self._drop_given_up(fb)
            return
        self.staged[fb.request_id] = Staged(fb, self.clock() + self.lease)
        self._count[SendState.STAGED] += 1
        candidates = self._regs_for(fb)
        staged = self.staged[fb.request_id]
        for rid in candidates:  # every D rank's registration: their WRITEs go at once
            if digest_ok(fb, self.regs[rid].reg) and staged.takes(rid[1]):
                self._match(fb.request_id, rid)
        if staged.matched:
            return
        for rid in candidates:  # same transfer, another prompt: none of them may have these
            if fb.request_id in self.staged:
                self._digest_mismatch(fb.request_id, rid)

    def _drop_given_up(self, fb: FinishedBlocks) -> None:
        """P prefilled a transfer it had already given up on (D cancelled it before the prefill
        ended; that cancel was acknowledged then, and the tombstone refuses a late PUSH_REG):
        nothing will be written, so the blocks go now, not at lease expiry. A registration
        another D rank left for it gets PUSH_FAIL."""
        logger.info("prefill of %s ended after its transfer was given up: freeing its blocks",
                    fb.request_id)
        self.done.add(fb.request_id)
        for key in self._regs_for(fb):
            self._fail(self.regs.pop(key), "prefill engine gave up this transfer (cancelled)")

    def on_aborted(self, request_id: str, transfer_id: str | None) -> None:
        """P's request ended without blocks to send: fail D's registration, now or later."""
        self._ended(request_id, transfer_id)
        fb = FinishedBlocks(request_id, transfer_id, [], 0)
        candidates = self._regs_for(fb)
        if candidates:
            for key in candidates:  # every D rank's registration of the best match
                if key[0] == candidates[0][0]:
                    self._fail(self.regs.pop(key), "prefill request aborted on P")
        else:
            self._tombstone(transfer_id, request_id)

    def on_registration(self, reg: Any, received_at: float | None = None,
                        agent: str | None = None) -> None:
        """`received_at`: the earliest time the registration may have arrived (the push thread
        passes its previous notification drain); the ttl counts from there. `agent`: the
        NIXL agent that sent it, which the registration then belongs to."""
        self.stats.add("kv_push_registrations_received_total")
        pending = PendingReg(reg, self.clock() if received_at is None else received_at, agent)
        refusal = self._over_capacity(reg, agent)
        if refusal is not None:
            self.stats.add("kv_push_registrations_refused_total")
            logger.warning("registration %s from agent %s refused: %s", reg.request_id,
                           agent or "?", refusal)
            self._fail(pending, refusal)
            return
        # start the reverse handshake early, with the D rank that registered
        peer = self.peers.get(pending.addr, reg.decode_tp_rank)
        key = reg_key(reg)
        held = self.regs.get(key)
        if held is not None and not self._owner(held, agent, "PUSH_REG"):
            return
        if peer.status == "ready" and not self._owner(pending, peer.agent_name, "PUSH_REG"):
            return
        if tomb_key(reg.transfer_id, reg.request_id) in self.tombstones:
            self._fail(pending, "prefill request already ended on P (aborted or expired)")
            return
        self.regs[key] = pending
        if self.unknown_timeout is not None and not self._carried(reg):
            pending.claim_by = self.clock() + self.unknown_timeout  # seen now: a frozen P
            # that wakes up gives its own requests (queued behind the freeze) the full time
        candidates = self._staged_for(reg)
        for pid in candidates:
            if digest_ok(self.staged[pid].blocks, reg):
                self._match(pid, key)
                return
        if candidates:
            self._digest_mismatch(candidates[0], key)

    def on_heartbeat(self, ids: list[str], agent: str | None = None) -> None:
        """D still waits: `ids` are transfer ids, or base request ids of transfers without.
        A transfer registered by another agent is refused (one not registered yet is not: D
        heartbeats while it queues, before its PUSH_REG)."""
        wanted = set(ids)
        owners: dict[str, list[PendingReg]] = {}  # one registration per D rank
        for p in [*self.regs.values(), *(w.reg for w in self.inflight)]:
            owners.setdefault(heartbeat_id(p.reg.request_id, p.reg.transfer_id), []).append(p)
        for hid in sorted(wanted & owners.keys()):
            if not any(p.agent in (None, agent) for p in owners[hid]) and not self._owner(
                    owners[hid][0], agent, "HB"):
                wanted.discard(hid)
        deadline = self.clock() + self.lease
        for p_id, staged in self.staged.items():
            if heartbeat_id(p_id, staged.blocks.transfer_id) in wanted:
                staged.lease_deadline = max(staged.lease_deadline, deadline)

    def on_cancel(self, d_request_id: str, transfer_id: str, agent: str | None = None) -> None:
        """D gave up. ACK once no WRITE for it can land: now, unless one is in flight.

        `agent` is the NIXL agent the cancel came from. A registration P no longer (or never)
        holds is acknowledged to it directly when P knows that agent: its WRITE is over, or
        the tombstone refuses a late PUSH_REG. Without the ACK, D would quarantine the blocks
        for 2 * ttl (e.g. after a lost completion)."""
        writes = [w for w in self.inflight if w.reg.reg.request_id == d_request_id]
        mine = [w for w in writes if agent is None or w.reg.agent in (None, agent)]
        if mine:
            mine[0].ack_cancel = True  # acknowledged once the WRITE is over
            return
        key = self._key_of(d_request_id, agent)
        held = self.regs.get(key)
        if held is None and writes:  # another agent's WRITE, nothing of this agent's
            self._owner(writes[0].reg, agent, "PUSH_CANCEL")  # refused
            return
        if held is not None and not self._owner(held, agent, "PUSH_CANCEL"):
            return
        pending = self.regs.pop(key, None)
        for p_id, staged in list(self.staged.items()):
            if key in staged.matched:
                staged.matched.remove(key)  # may pair with another registration
                self._sync(p_id)
        if pending is not None:  # a D rank P writes among others gave up: the rest is moot
            for p_id, staged in list(self.staged.items()):
                if staged.expected > 1 and key[1] not in staged.written and match_rank(
                        staged.blocks, pending.reg) is not None:
                    self._give_up(p_id)
        self._tombstone(transfer_id, d_request_id)
        self._drop_cancelled(tomb_key(transfer_id, d_request_id))
        ack = wire.encode_push_cancel_ack(d_request_id, transfer_id)
        if pending is not None:
            self._send(pending.addr, ack, pending.agent)
        elif agent is not None and agent in self.t.peers():
            try:
                self.t.send_notif(agent, ack)
            except Exception as e:  # noqa: BLE001 - D's quarantine deadline still holds
                logger.warning("PUSH_CANCEL_ACK for %s to %s failed: %s", d_request_id, agent, e)
        else:
            logger.info("cancel for unknown registration %s (transfer %s) from unknown agent "
                        "%s: no ack", d_request_id, transfer_id, agent)

    def _drop_cancelled(self, tomb: str) -> None:
        """The transfer `tomb` is cancelled (tombstoned: no later registration can take its
        blocks): blocks staged for it that no D rank has matched or written go now, not at
        lease expiry. Blocks paired with another agent's registration are that agent's
        business (the cancel does not end its WRITE)."""
        for p_id, staged in list(self.staged.items()):
            if tomb_key(staged.blocks.transfer_id, p_id) == tomb and not staged.busy_ranks():
                logger.info("transfer of %s cancelled by D before any registration took its "
                            "blocks: freeing them", p_id)
                self._release(p_id, failed=True)

    def _key_of(self, d_request_id: str, agent: str | None) -> RegKey:
        """The registration of D request `d_request_id` that `agent` (one of D's ranks) holds;
        another D rank's when none is that agent's (the caller refuses it)."""
        keys = [k for k in self.regs if k[0] == d_request_id]
        mine = [k for k in keys if self.regs[k].agent in (None, agent)]
        return (mine or keys or [(d_request_id, 0)])[0]

    # --- the poll -----------------------------------------------------------------
    def poll(self) -> None:
        now = self.clock()
        self._post_ready(now)
        self._check_inflight(now)
        self._expire(now)
        self.refused += self.outbox.flush()

    def needs_poll(self) -> bool:
        """Self-poll while blocks wait unmatched, WRITEs are in flight or notifs queue."""
        return bool(self.staged or self.outbox)  # WRITEs in flight are staged too

    def next_deadline(self) -> float | None:
        """When the next registration must be carried by a P request (None: none waits)."""
        times = [p.claim_by for p in self.regs.values() if p.claim_by is not None]
        return min(times) if times else None

    # --- internals ----------------------------------------------------------------
    def _over_capacity(self, reg: Any, agent: str) -> str | None:
        n = sum(len(group) for group in reg.local_block_ids)
        if n > self.num_blocks:
            return f"registration names {n} blocks, more than this engine's {self.num_blocks}"
        if reg.decode_tp_rank >= reg.decode_tp_size or self.tp_rank not in peer_ranks(
                reg.decode_tp_rank, reg.decode_tp_size, self.tp_size):
            return (f"D's TP rank {reg.decode_tp_rank} of {reg.decode_tp_size} holds none of "
                    f"the KV heads of this P rank ({self.tp_rank} of {self.tp_size})")
        if reg_key(reg) in self.regs:
            return None  # replaces its own entry
        if len(self.regs) >= MAX_REGS:
            return f"too many pending registrations ({MAX_REGS})"
        mine = sum(1 for p in self.regs.values() if p.agent == agent)
        if mine >= MAX_REGS_PER_AGENT:
            return f"too many pending registrations from agent {agent} ({MAX_REGS_PER_AGENT})"
        return None

    def _owner(self, pending: PendingReg, agent: str | None, what: str) -> bool:
        """Whether `agent` may act on this registration; counts and logs a refusal."""
        if pending.agent is None or agent is None or agent == pending.agent:
            return True
        self.refused += 1
        reg = pending.reg
        logger.warning("refused %s for D request %s (transfer %s): agent %s, but the "
                       "registration belongs to agent %s (D address %s:%d)", what,
                       reg.request_id, reg.transfer_id, agent, pending.agent, *pending.addr)
        return False

    def addresses_in_use(self) -> set[tuple[str, int]]:
        """D addresses a registration, WRITE or notification still needs."""
        used = {p.addr for p in self.regs.values()}
        used |= {w.reg.addr for w in self.inflight}
        used |= self.outbox.addresses()
        return used

    def _regs_for(self, fb: FinishedBlocks, busy: set[int] | None = None) -> list[RegKey]:
        """Unmatched registrations naming fb's transfer, best first (see `_rank`), from D
        ranks not in `busy` (written, being written or matched)."""
        taken = {k for s in self.staged.values() for k in s.matched}
        ranked = [(r, key) for key, p in self.regs.items()
                  if key not in taken and key[1] not in (busy or ())
                  and (r := match_rank(fb, p.reg)) is not None]
        return [key for _, key in sorted(ranked, key=lambda x: x[0])]

    def _staged_for(self, reg: Any) -> list[str]:
        """Staged P requests naming reg's transfer, best first, that still take reg's D rank
        (not written, writing or matched; another D rank's WRITE may be in flight)."""
        ranked = [(r, pid) for pid, s in self.staged.items()
                  if s.takes(reg.decode_tp_rank) and (r := match_rank(s.blocks, reg)) is not None]
        return [pid for _, pid in sorted(ranked, key=lambda x: x[0])]

    def _digest_mismatch(self, p_id: str, d_id: RegKey) -> None:
        """Same transfer, different prompt: D's registration is refused (D recomputes). With
        a transfer id the transfer is spoiled, so P's blocks go too; without one they stay for
        a registration of their own prompt (a client may reuse a request id)."""
        pending = self.regs.pop(d_id)
        staged = self.staged[p_id]
        self.stats.add("kv_push_digest_mismatch_total")
        logger.warning("registration %s (transfer %r) from D %s:%d has another prompt than P "
                       "request %s: not writing", d_id, pending.reg.transfer_id, *pending.addr,
                       p_id)
        self._fail(pending, "prompt digest mismatch: D's prompt differs from the one P "
                            "prefilled for this transfer")
        if staged.blocks.transfer_id:
            self._tombstone(staged.blocks.transfer_id, p_id)
            self._give_up(p_id)

    def _match(self, p_id: str, d_id: RegKey) -> None:
        """Pair with registration `d_id` (STAGED → MATCHED, or one more while another D rank's
        WRITE is in flight); the registration's D size says how many D ranks this P rank's
        heads go to."""
        staged = self.staged[p_id]
        if not staged.matched:
            staged.match_seq = next(self._seq)
        staged.matched.append(d_id)
        reg = self.regs[d_id].reg
        staged.expected = len(peer_ranks(self.tp_rank, self.tp_size, reg.decode_tp_size))
        self._sync(p_id)

    def _post_ready(self, now: float) -> None:
        for p_id, d_id in self.ready:
            staged = self.staged.get(p_id)
            if staged is None or d_id not in staged.matched:
                continue  # given up or released by an earlier one of this loop
            pending = self.regs.get(d_id)
            if pending is None:  # the registration ended (its ttl): P's blocks wait on
                staged.matched.remove(d_id)
                self._sync(p_id)
                continue
            peer = self.peers.get(pending.addr)
            if peer.status == "pending":
                continue
            del self.regs[d_id]
            staged.matched.remove(d_id)
            self._sync(p_id)
            if not self._owner(pending, peer.agent_name, "WRITE to the address's agent"):
                # The agent D's address serves is not the one that registered: never write.
                other = next((r for r in self._regs_for(staged.blocks, staged.busy_ranks())
                              if digest_ok(staged.blocks, self.regs[r].reg)), None)
                if other is not None:
                    self._match(p_id, other)
            elif peer.status == "failed":
                # D is unreachable, so it cannot be told either: its watchdog decides.
                self._give_up(p_id)
            else:
                self._post(p_id, pending, peer.agent_name, now)

    def _post(self, p_id: str, pending: PendingReg, agent: str, now: float) -> None:
        """Post the WRITE, or refuse: every path either records an in-flight WRITE or sends
        PUSH_FAIL and releases P's blocks, whatever raises on the way."""
        try:
            reason = self._try_post(p_id, pending, agent, now)
        except Exception as e:  # noqa: BLE001 - a failed post is a PUSH_FAIL, not a lost request
            self.stats.add("kv_push_write_failures_total")
            reason = f"WRITE submission failed: {type(e).__name__}: {e}"
        if reason is None:
            return
        logger.warning("not writing %s -> D %s: %s", p_id, pending.reg.request_id, reason)
        self._fail(pending, reason)
        self._give_up(p_id)

    def _try_post(self, p_id: str, pending: PendingReg, agent: str, now: float
                  ) -> str | None:
        """Post the WRITE (None) or say why not."""
        reg, staged = pending.reg, self.staged[p_id]
        d_ids = [b for group in reg.local_block_ids for b in group]
        first = reg.first_block_index
        p_ids = staged.blocks.block_ids[first:first + len(d_ids)]
        if now - pending.received_at > self.ttl:
            return f"registration older than its ttl ({self.ttl:.0f}s)"
        if len(p_ids) != len(d_ids) or not d_ids:
            return (f"block count mismatch: D registered {len(d_ids)} from block {first}, "
                    f"P holds {len(staged.blocks.block_ids)}")
        token = staged.blocks.first_token if reg.first_token else None
        notif = (wire.encode_completion(reg.request_id, self.tp_size) if token is None
                 else wire.encode_completion_with_token(reg.request_id, self.tp_size, token))
        handle = self.t.write(agent, p_ids, d_ids, notif)
        if self.poker is not None:  # D polls its agent fast from now on (kvconnector/poke.py)
            self.poker.poke(pending.addr)
        # a WRITE of our heads into a D of another TP size moves part of each block
        nbytes = getattr(handle, "nbytes", len(d_ids) * self.bytes_per_block)
        staged.writes[reg.decode_tp_rank] = Inflight(p_id, pending, handle, now, nbytes)
        self._sync(p_id)
        return None

    def _check_inflight(self, now: float) -> None:
        for w in self.inflight:
            state = self.t.check(w.handle)
            if state == "PROC":
                continue
            self.t.release(w.handle)
            reg = w.reg.reg
            staged = self.staged[w.p_request_id]
            del staged.writes[reg.decode_tp_rank]
            if state == "DONE":
                staged.written.add(reg.decode_tp_rank)
                self.stats.add("kv_push_writes_total")
                self.stats.add("kv_transfer_bytes_total", w.nbytes)
                transfer_hist.observe(self.stats.counters, now - w.started)
            else:
                self.stats.add("kv_push_write_failures_total")
                self._fail(w.reg, "WRITE failed in transfer")
                staged.failed = True  # no more WRITEs; the blocks go after those in flight
                staged.matched.clear()
            if w.ack_cancel:
                self._send(w.reg.addr, wire.encode_push_cancel_ack(reg.request_id,
                                                                   reg.transfer_id),
                           w.reg.agent)
            self._write_over(w.p_request_id)

    def _write_over(self, p_id: str) -> None:
        """One of its WRITEs is over. The blocks go once none is in flight: failed if one
        failed or P gave up, done when every D rank is written; otherwise it waits (STAGED)
        for the next D rank's registration, pairing now if it is here (the lease still bounds
        the wait)."""
        staged = self._sync(p_id)
        if staged.writes:
            return
        if staged.failed or tomb_key(staged.blocks.transfer_id, p_id) in self.tombstones:
            self._release(p_id, failed=True)  # a WRITE failed, or D cancelled
        elif len(staged.written) >= staged.expected:
            self._release(p_id, failed=False)
        elif not staged.matched:
            for key in self._regs_for(staged.blocks, staged.busy_ranks()):
                if digest_ok(staged.blocks, self.regs[key].reg):
                    self._match(p_id, key)
                    return

    def _give_up(self, p_id: str) -> None:
        """P will not write this request any more: its blocks go now, or once the WRITEs in
        flight are over (they read them); `_release` fails the D ranks not written."""
        staged = self.staged[p_id]
        if not staged.writes:
            self._release(p_id, failed=True)
            return
        staged.failed = True
        staged.matched.clear()  # still held in `regs`: failed at the release
        self._sync(p_id)

    def _expire(self, now: float) -> None:
        for p_id, staged in list(self.staged.items()):
            if now >= staged.lease_deadline and staged.state is not SendState.WRITING:
                self.stats.add("kv_lease_expired_total")
                logger.warning("lease of %s expired after %.1fs unclaimed", p_id, self.lease)
                self._tombstone(staged.blocks.transfer_id, p_id)
                self._release(p_id, failed=True)
        for rid, pending in list(self.regs.items()):
            if now - pending.received_at > self.ttl:
                del self.regs[rid]
                self._fail(pending, "no prefill for this registration within its ttl")
            elif pending.claim_by is not None and now >= pending.claim_by:
                self._check_claimed(rid, pending)
        for key, expiry in list(self.tombstones.items()):
            if now >= expiry:
                del self.tombstones[key]

    def _carried(self, reg: Any) -> bool:
        """Whether a P request of this engine carries reg's transfer: arrived in P's
        scheduler (prefilling) or staged."""
        key = tomb_key(reg.transfer_id, reg.request_id)
        return key in self.prefilling or any(
            tomb_key(s.blocks.transfer_id, p_id) == key for p_id, s in self.staged.items())

    def _check_claimed(self, key: RegKey, pending: PendingReg) -> None:
        """`unknown_timeout` after it arrived, a registration no P request carries is a stray
        (a D leg sent without its P leg, a made-up or mistaken transfer): PUSH_FAIL, so D
        frees its blocks and computes the prompt itself."""
        pending.claim_by = None
        if self._carried(pending.reg):
            return  # its ttl bounds it from now on
        del self.regs[key]
        self.stats.add("kv_push_unknown_transfer_total")
        reg = pending.reg
        logger.warning("registration %s (transfer %r) from D %s:%d: no request on this engine "
                       "carries its transfer after %.1fs: refused", reg.request_id,
                       reg.transfer_id, *pending.addr, self.unknown_timeout)
        self._fail(pending, f"unknown transfer: no request on this prefill engine carries it "
                            f"(waited {self.unknown_timeout:.1f}s)")

    def _release(self, p_id: str, failed: bool) -> None:
        """The P request ends: its blocks may be freed (whatever its state). A failure while
        other D ranks still wait for their share fails them too: now if P holds their
        registrations, by tombstone when they come later."""
        staged = self.staged.pop(p_id, None)
        if staged is None:
            return
        self._count[staged.state] -= 1
        self.done.add(p_id)
        if failed and staged.expected > 1:
            self._tombstone(staged.blocks.transfer_id, p_id)
            for key in self._regs_for(staged.blocks, staged.written):
                self._fail(self.regs.pop(key), "prefill engine gave up this transfer (a "
                                               "WRITE to another D rank failed)")

    def _tombstone(self, transfer_id: str | None, request_id: str) -> None:
        self.tombstones[tomb_key(transfer_id, request_id)] = self.clock() + self.ttl

    def _fail(self, pending: PendingReg, reason: str) -> None:
        self.stats.add("kv_push_fail_sent_total")
        reg = pending.reg
        try:
            msg = wire.encode_push_fail(reg.request_id, reg.transfer_id, reason)
        except ValueError as e:  # cannot happen for a decoded registration; D's watchdog holds
            logger.error("PUSH_FAIL for %s not encodable: %s", reg.request_id, e)
            return
        self._send(pending.addr, msg, pending.agent)

    def _send(self, addr: tuple[str, int], msg: bytes, agent: str | None = None) -> None:
        """Queue `msg` for D at `addr`; with `agent`, only if `addr` serves that agent."""
        self.refused += self.outbox.send(addr, msg, agent)
        if self.poker is not None:  # D waits for it on a slow poll until poked
            self.poker.poke(addr)

    def table_sizes(self) -> dict[str, int]:
        return {"p_staged": len(self.staged), "p_regs": len(self.regs),
                "p_prefilling": sum(self.prefilling.values()),
                "p_inflight": len(self.inflight), "p_ready": len(self.ready),
                "p_outbox": len(self.outbox)}
