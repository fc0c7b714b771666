"""Remote engines the transfer thread talks to, keyed by side-channel address (host, port).

Handshakes (a blocking side-channel fetch) run on executors; their results are handed back
through a queue and applied on the transfer thread, which alone touches the NIXL agent
(`add_peer`, `remove_peer`) and this table. A failed handshake is remembered for
`retry_after` seconds so a burst of requests to a dead peer fails fast instead of each
waiting for a timeout.

Bounded state, whatever remote input names (docs/design.md §4, invariant 7):
- two executors: addresses that completed a handshake before (re-handshakes, liveness
  probes) never queue behind first contacts, and each first contact gets its own thread
  (up to `MAX_FIRST_CONTACTS` at once, more fail at once), so an address that never answers
  cannot delay a reachable one's handshake;
- at most `MAX_PEERS` addresses; an address idle for `idle_after` seconds that no transfer
  still needs is dropped by `prune`, and so is its NIXL agent.

An agent name stays bound to the address it was first loaded from (`NixlTransport.add_peer`).
When another address serves a blob under a bound name, the handshake stays pending while the
bound address is probed: if nobody answers there any more ("gone": the first was an impostor
or a relay that left, or the engine moved), the name is unbound and the new blob loaded;
otherwise the new blob is refused and counted (`kv_refused_peers_total`). So the first to
claim a name keeps it only while it keeps serving it.

Liveness probes answer "alive" (the same agent answers), "gone" (connection refused, or a
different agent or blob answers: the process we knew has exited) or "silent" (no answer: frozen,
overloaded or cut off — it may still write later).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

Address = tuple[str, int]
MAX_PEERS = 4096
MAX_FIRST_CONTACTS = 256
_KNOWN_WORKERS = 4
ALIVE, GONE, SILENT = "alive", "gone", "silent"


@dataclass
class PeerState:
    status: str  # "pending" | "ready" | "failed"
    agent_name: str | None = None
    engine_id: str | None = None
    reason: str = ""
    failed_at: float = 0.0
    last_used: float = 0.0
    agent_blob: bytes | None = None  # what the handshake loaded (a probe compares it)
    tp_rank: int | None = None  # the TP rank the address serves, when the caller named it


def probe_verdict(exc: BaseException | None, meta: Any, known_agent: str | None,
                  known_blob: bytes | None = None) -> str:
    """How a liveness probe ended: ALIVE, GONE or SILENT (see the module docstring). A new
    blob under the same name is a new process too (an engine restarted with a fixed id)."""
    if exc is None:
        if known_agent is None:
            return ALIVE
        same_blob = known_blob is None or getattr(meta, "agent_blob", None) == known_blob
        return ALIVE if meta.agent_name == known_agent and same_blob else GONE
    refused = getattr(exc, "cause", "") == "unreachable" and "refused" in str(exc)
    return GONE if refused else SILENT


class Peers:
    def __init__(self, fetch: Callable[[str, int], Any], add_peer: Callable[[Any, str], str],
                 wake: threading.Event, clock: Callable[[], float],
                 retry_after: float = 5.0, *,
                 remove_peer: Callable[[str], None] | None = None,
                 unbind: Callable[[str, str | None], None] | None = None,
                 refused: Callable[[Exception], None] | None = None,
                 idle_after: float = 60.0) -> None:
        # (host, port[, tp_rank]) -> metadata, raises on failure (any thread)
        self._fetch = fetch
        # (metadata, "host:port" it came from) -> agent name (writer thread only)
        self._add_peer = add_peer
        self._remove_peer = remove_peer  # agent name -> None (transfer thread only)
        self._unbind = unbind  # (agent name, bound "host:port"): free a gone peer's name
        self._refused = refused  # a blob finally refused for a name bound elsewhere
        self._wake = wake
        self._clock = clock
        self._retry_after = retry_after
        self._idle_after = idle_after
        self._peers: dict[Address, PeerState] = {}
        self._first_contacts = 0
        self._done: queue.SimpleQueue[tuple[Address, Any, BaseException | None, bool]] = (
            queue.SimpleQueue())
        # binding checks: (address, its blob, the conflict, the bound address, its verdict)
        self._checked: queue.SimpleQueue[tuple[Address, Any, Any, Address, str]] = (
            queue.SimpleQueue())
        self._known_pool = ThreadPoolExecutor(max_workers=_KNOWN_WORKERS,
                                              thread_name_prefix="nixl-handshake")
        self._new_pool = ThreadPoolExecutor(max_workers=MAX_FIRST_CONTACTS,
                                            thread_name_prefix="nixl-first-contact")

    def get(self, addr: Address, tp_rank: int | None = None) -> PeerState:
        """Current state of the peer, starting (or retrying) a handshake when needed.
        `tp_rank`: the TP rank the address serves (the handshake asks for it; docs/design.md
        §8), remembered with the peer; None: the one named before, or the fetch's default."""
        now = self._clock()
        state = self._peers.get(addr)
        if tp_rank is None and state is not None:
            tp_rank = state.tp_rank
        stale = (state is not None and state.status == "failed"
                 and now - state.failed_at >= self._retry_after)
        if state is None and len(self._peers) >= MAX_PEERS:
            return PeerState("failed", reason=f"too many KV peers (> {MAX_PEERS})",
                             failed_at=now)
        if state is None or stale:
            # A retry keeps the agent name: NIXL still holds that agent, and a PUSH_CANCEL
            # must still reach it (see `known_agent`).
            known = state.agent_name if state else None
            state = self._start(addr, known, now, tp_rank)
        state.last_used = now
        return state

    def _start(self, addr: Address, known: str | None, now: float,
               tp_rank: int | None) -> PeerState:
        first = known is None
        if first and self._first_contacts >= MAX_FIRST_CONTACTS:
            state = PeerState("failed", reason="too many first handshakes in progress",
                              failed_at=now, last_used=now)
            self._peers[addr] = state
            return state
        state = PeerState("pending", agent_name=known, last_used=now, tp_rank=tp_rank)
        self._peers[addr] = state
        self._first_contacts += first
        pool = self._new_pool if first else self._known_pool
        future = pool.submit(self._fetch_meta, addr, tp_rank)
        future.add_done_callback(lambda f, a=addr, fc=first: self._on_done(a, f, fc))
        return state

    def _on_done(self, addr: Address, future: Future, first: bool) -> None:
        exc = None if future.cancelled() else future.exception()
        meta = None if exc is not None or future.cancelled() else future.result()
        self._done.put((addr, meta, exc, first))
        self._wake.set()

    def apply_finished(self) -> None:
        """Transfer thread: turn finished handshakes into ready or failed peers."""
        self._apply_checks()
        while True:
            try:
                addr, meta, exc, first = self._done.get_nowait()
            except queue.Empty:
                return
            self._first_contacts -= first
            state = self._peers.get(addr)
            if state is None or state.status != "pending":
                continue  # forgotten meanwhile
            if exc is None and meta is not None:
                exc = self._load(addr, state, meta)
                if exc is None:
                    continue
                if getattr(exc, "bound", None) is not None and self._unbind is not None:
                    self._check_binding(addr, meta, exc)
                    continue
                if self._refused is not None and hasattr(exc, "bound"):
                    self._refused(exc)
            self._fail(addr, state, exc)

    def _load(self, addr: Address, state: PeerState, meta: Any) -> Exception | None:
        try:
            old = state.agent_name
            state.agent_name = self._add_peer(meta, f"{addr[0]}:{addr[1]}")
        except Exception as e:  # noqa: BLE001 - a bad peer must not kill the thread
            return e
        state.engine_id = getattr(meta, "engine_id", None)
        state.agent_blob = getattr(meta, "agent_blob", None)
        state.status = "ready"
        if old is not None and old != state.agent_name:
            self._drop_agent(old)  # the peer restarted: its old agent is gone
        logger.info("handshake with %s:%d done (%s)", *addr, state.agent_name)
        return None

    def _fail(self, addr: Address, state: PeerState, exc: BaseException | None) -> None:
        state.status, state.reason, state.failed_at = "failed", str(exc), self._clock()
        logger.warning("handshake with %s:%d failed: %s", *addr, exc)

    def _check_binding(self, addr: Address, meta: Any, conflict: Any) -> None:
        """`addr` served a blob under a name bound to another address: probe that one (the
        handshake stays pending meanwhile; `_apply_checks` decides)."""
        host, _, port = str(conflict.bound).rpartition(":")
        bound: Address = (host.strip("[]"), int(port))

        def run() -> None:
            try:
                found, exc = self._fetch_meta(bound, None), None
            except Exception as e:  # noqa: BLE001 - any failure is a verdict
                found, exc = None, e
            self._checked.put((addr, meta, conflict, bound,
                               probe_verdict(exc, found, conflict.name)))
            self._wake.set()
        self._known_pool.submit(run)

    def _apply_checks(self) -> None:
        while True:
            try:
                addr, meta, conflict, bound, verdict = self._checked.get_nowait()
            except queue.Empty:
                return
            state = self._peers.get(addr)
            if state is None or state.status != "pending":
                continue
            if verdict == GONE:
                self.forget(bound)
                self._unbind(conflict.name, conflict.bound)
                logger.info("KV peer %s no longer serves %s: %s:%d may take the name",
                            conflict.bound, conflict.name, *addr)
                exc = self._load(addr, state, meta)
                if exc is None:
                    continue
            else:
                exc = conflict
                if self._refused is not None:
                    self._refused(conflict)
            self._fail(addr, state, exc)

    def known_agent(self, addr: Address) -> str | None:
        """The NIXL agent loaded for this peer, whatever its status now (or None).

        A peer marked failed for not answering may only be frozen or partitioned: messages
        that must not be lost (PUSH_CANCEL) still go to it and are delivered, in order,
        if it ever comes back."""
        state = self._peers.get(addr)
        return state.agent_name if state is not None else None

    def mark_failed(self, addr: Address, reason: str) -> None:
        state = self._peers.setdefault(addr, PeerState("failed"))
        state.status, state.reason, state.failed_at = "failed", reason, self._clock()

    def revive(self, addr: Address) -> bool:
        """A failed peer whose loaded agent answered a probe is ready again (True if so)."""
        state = self._peers.get(addr)
        if state is None or state.status != "failed" or state.agent_name is None:
            return False
        state.status, state.reason = "ready", ""
        logger.info("KV peer %s:%d (%s) answers again", *addr, state.agent_name)
        return True

    def forget(self, addr: Address) -> None:
        """The process behind this address is gone: drop the entry and its NIXL agent, so
        the next request handshakes afresh (with whatever listens there now)."""
        state = self._peers.pop(addr, None)
        if state is not None and state.agent_name is not None:
            self._drop_agent(state.agent_name)

    def failed_with_agent(self) -> list[Address]:
        """Peers marked failed whose agent is still loaded: probe them to bring them back."""
        return [a for a, s in self._peers.items()
                if s.status == "failed" and s.agent_name is not None]

    def prune(self, in_use: Iterable[Address]) -> int:
        """Drop peers idle for `idle_after` that no transfer needs (transfer thread)."""
        keep, now = set(in_use), self._clock()
        idle = [a for a, s in self._peers.items()
                if a not in keep and s.status != "pending"
                and now - s.last_used >= self._idle_after]
        for addr in idle:
            logger.info("KV peer %s:%d idle for %.0fs: dropped", *addr, self._idle_after)
            self.forget(addr)
        return len(idle)

    def _drop_agent(self, agent: str) -> None:
        if self._remove_peer is None:
            return
        if any(s.agent_name == agent for s in self._peers.values()):
            return  # another address still maps to it
        try:
            self._remove_peer(agent)
        except Exception as e:  # noqa: BLE001 - a stale agent costs memory, not correctness
            logger.warning("removing NIXL agent %s failed: %s", agent, e)

    def probe(self, addr: Address, on_result: Callable[[Address, str, str | None], None]
              ) -> None:
        """Liveness check on the executor: `on_result(addr, verdict, agent probed)` runs
        there, so it must only enqueue. Verdicts: ALIVE, GONE, SILENT."""
        state = self._peers.get(addr)
        known = state.agent_name if state is not None else None
        blob = state.agent_blob if state is not None else None
        rank = state.tp_rank if state is not None else None

        def run() -> None:
            try:
                meta, exc = self._fetch_meta(addr, rank), None
            except Exception as e:  # noqa: BLE001 - any failure is a verdict
                meta, exc = None, e
            on_result(addr, probe_verdict(exc, meta, known, blob), known)
            self._wake.set()
        self._known_pool.submit(run)

    def _fetch_meta(self, addr: Address, tp_rank: int | None) -> Any:
        if tp_rank is None:
            return self._fetch(addr[0], addr[1])
        return self._fetch(addr[0], addr[1], tp_rank)

    def pending(self) -> bool:
        return any(s.status == "pending" for s in self._peers.values())

    def table_sizes(self) -> dict[str, int]:
        sizes = {"peers_ready": 0, "peers_pending": 0, "peers_failed": 0}
        for s in self._peers.values():
            sizes[f"peers_{s.status}"] += 1
        return sizes

    def shutdown(self) -> None:
        self._known_pool.shutdown(wait=False, cancel_futures=True)
        self._new_pool.shutdown(wait=False, cancel_futures=True)
