"""D side of pull mode: READ P's leased blocks into D's preallocated ones.

Owned by the pull thread. Per request: claim (queued on D, heartbeat P) → read staged
(waiting for the handshake with P) → READ in flight → over. Guarantees:
- a request ends in exactly one of `finished_recving` (READ DONE), `failed_recving` (with a
  reason naming P's engine id and host:port), or — when the scheduler released it first —
  `done` (finished_sending: its blocks may be freed), reported only once no READ can still
  land in its blocks (NIXL reported DONE or ERR, or no READ was ever posted);
- P hears `<P request id>:1` once D is done with its blocks, whatever the outcome, when P
  is reachable; otherwise P's lease expiry frees them;
- P's lease is extended (`HB:<P ids>`, every `hb_interval`) while the request waits in D's
  queue, for the handshake, or for its READ.
A READ is never abandoned while NIXL reports it in flight: D moves the bytes itself, so a
READ it gave up on could still land in blocks given to another request. A dead P turns the
READ to ERR within milliseconds; a frozen one keeps it in flight (logged once it outlasts
`stall_warning_s`) until P resumes or dies, and an aborted request's blocks stay held so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.connector_seam import SeededToken
from kvconnector import transfer_hist, wire
from kvconnector.outbox import Outbox
from kvconnector.peers import Peers
from kvconnector.pull.meta import Address, Claim, Read

logger = logging.getLogger(__name__)


@dataclass
class Inflight:
    read: Read
    handle: Any
    started: float
    nbytes: int
    warned: bool = False


def _where(claim: Claim) -> str:
    return f"prefill engine {claim.remote_engine_id} at {claim.remote_host}:{claim.remote_port}"


class Reader:
    def __init__(self, transport: Any, peers: Peers, clock: Callable[[], float], *,
                 hb_interval: float, bytes_per_block: int, stats: dict[str, float],
                 stall_warning_s: float = 30.0) -> None:
        self.t = transport
        self.peers = peers
        self.clock = clock
        self.hb_interval = hb_interval
        self.bytes_per_block = bytes_per_block
        self.stats = stats
        self.stall_warning_s = stall_warning_s
        self.claims: dict[str, Claim] = {}  # queued on D: heartbeat only
        self.unsent: dict[str, Read] = {}  # waiting for the handshake with P
        self.inflight: dict[str, Inflight] = {}
        self.released: set[str] = set()  # the scheduler let go while the READ runs
        self.outbox = Outbox(transport, peers)  # completions waiting for P's peer
        self.finished_recving: set[str] = set()
        self.failed_recving: dict[str, str] = {}
        self.seeded: dict[str, SeededToken] = {}  # pull: P's token rides in the params
        self.done: set[str] = set()
        self._next_hb = 0.0

    # --- events from the scheduler ------------------------------------------------
    def on_claim(self, claim: Claim) -> None:
        self.claims[claim.request_id] = claim
        self.peers.get(claim.addr)  # handshake while D queues

    def on_read(self, read: Read) -> None:
        self.claims.pop(read.claim.request_id, None)
        self.unsent[read.claim.request_id] = read

    def on_released(self, rid: str) -> None:
        if rid in self.inflight:
            self.released.add(rid)
            return
        read = self.unsent.pop(rid, None)
        claim = read.claim if read is not None else self.claims.pop(rid, None)
        if claim is not None:
            self._return_lease(claim)
        self.done.add(rid)

    def on_abandoned(self, rid: str) -> None:
        read = self.unsent.pop(rid, None)
        claim = read.claim if read is not None else self.claims.pop(rid, None)
        if claim is not None:
            self._return_lease(claim)

    # --- the poll -----------------------------------------------------------------
    def poll(self) -> None:
        now = self.clock()
        self._post_unsent(now)
        self._check_inflight(now)
        self.outbox.flush()
        if now >= self._next_hb:
            self._next_hb = now + self.hb_interval
            self._heartbeat()

    def needs_poll(self) -> bool:
        """Poll while a READ is coming (it progresses only while polled) or must start."""
        return bool(self.unsent or self.inflight or self.outbox)

    def next_deadline(self) -> float | None:
        return self._next_hb if self.claims else None

    # --- internals ----------------------------------------------------------------
    def _post_unsent(self, now: float) -> None:
        for rid, read in list(self.unsent.items()):
            claim = read.claim
            peer = self.peers.get(claim.addr)
            if peer.status == "pending":
                continue
            del self.unsent[rid]
            if peer.status == "failed":
                self._fail(rid, f"handshake with {_where(claim)} failed: {peer.reason}")
                continue
            if peer.engine_id is not None and peer.engine_id != claim.remote_engine_id:
                self._fail(rid, f"{_where(claim)}: the side channel there serves engine "
                                f"{peer.engine_id}")
                continue
            try:
                handle = self.t.read(peer.agent_name, read.local_block_ids,
                                     read.remote_block_ids)
            except Exception as e:  # noqa: BLE001 - a failed post is a failed load
                self._fail(rid, f"READ from {_where(claim)} could not start: {e}")
                self._return_lease(claim)
                self._suspect(claim, str(e))
                continue
            nbytes = len(read.local_block_ids) * self.bytes_per_block
            self.inflight[rid] = Inflight(read, handle, now, nbytes)

    def _check_inflight(self, now: float) -> None:
        for rid, f in list(self.inflight.items()):
            state = self.t.check(f.handle)
            if state == "PROC":
                if not f.warned and now - f.started > self.stall_warning_s:
                    f.warned = True
                    logger.warning("READ for %s from %s in flight for %.0fs; its blocks stay "
                                   "held until it ends", rid, _where(f.read.claim),
                                   now - f.started)
                continue
            del self.inflight[rid]
            self.t.release(f.handle)
            claim = f.read.claim
            self._return_lease(claim)
            released = rid in self.released
            self.released.discard(rid)
            if state == "DONE":
                self.stats["kv_pull_reads_total"] += 1
                self.stats["kv_transfer_bytes_total"] += f.nbytes
                transfer_hist.observe(self.stats, now - f.started)
                if not released:
                    self.finished_recving.add(rid)
            else:
                self._suspect(claim, "a READ failed in transfer")
                if not released:
                    self._fail(rid, f"READ from {_where(claim)} failed in transfer")
            if released:
                self.done.add(rid)

    def _fail(self, rid: str, reason: str) -> None:
        logger.warning("receiving KV for %s failed: %s", rid, reason)
        self.failed_recving[rid] = reason

    def _suspect(self, claim: Claim, reason: str) -> None:
        """P may have died or restarted: handshake afresh (after Peers' retry delay) instead
        of reusing agent metadata that may be stale."""
        self.peers.mark_failed(claim.addr, f"{_where(claim)}: {reason}")

    def _return_lease(self, claim: Claim) -> None:
        """Tell P its blocks are no longer needed (once P is reachable)."""
        self.outbox.send(claim.addr, wire.encode_completion(claim.remote_request_id, 1))

    def _heartbeat(self) -> None:
        by_peer: dict[Address, list[str]] = {}
        claims = [*self.claims.values(), *(r.claim for r in self.unsent.values()),
                  *(f.read.claim for f in self.inflight.values())]
        for c in claims:
            by_peer.setdefault(c.addr, []).append(c.remote_request_id)
        for addr, ids in by_peer.items():
            peer = self.peers.get(addr)
            if peer.status != "ready":
                continue
            try:
                self.t.send_notif(peer.agent_name, wire.encode_heartbeat(ids))
            except Exception as e:  # noqa: BLE001 - the READ itself will report a dead P
                logger.warning("heartbeat to P %s:%d failed: %s", *addr, e)

    def table_sizes(self) -> dict[str, int]:
        return {"pull_claims": len(self.claims), "pull_unsent": len(self.unsent),
                "pull_inflight": len(self.inflight), "pull_released": len(self.released),
                "pull_outbox": len(self.outbox)}
