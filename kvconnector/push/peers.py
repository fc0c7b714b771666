"""Remote engines the writer talks to, keyed by side-channel address (host, port).

Handshakes (a blocking side-channel fetch) run on a small executor; their results are
handed back through a queue and applied on the writer thread, which alone touches the
NIXL agent (`add_peer`). A failed handshake is remembered for `retry_after` seconds so a
burst of requests to a dead peer fails fast instead of each waiting for a timeout.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

Address = tuple[str, int]


@dataclass
class PeerState:
    status: str  # "pending" | "ready" | "failed"
    agent_name: str | None = None
    engine_id: str | None = None
    reason: str = ""
    failed_at: float = 0.0


class Peers:
    def __init__(self, fetch: Callable[[str, int], Any], add_peer: Callable[[Any, str], str],
                 wake: threading.Event, clock: Callable[[], float],
                 retry_after: float = 5.0) -> None:
        self._fetch = fetch  # (host, port) -> metadata, raises on failure (any thread)
        # (metadata, "host:port" it came from) -> agent name (writer thread only)
        self._add_peer = add_peer
        self._wake = wake
        self._clock = clock
        self._retry_after = retry_after
        self._peers: dict[Address, PeerState] = {}
        self._done: queue.SimpleQueue[tuple[Address, Any, BaseException | None]] = (
            queue.SimpleQueue())
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="nixl-handshake")

    def get(self, addr: Address) -> PeerState:
        """Current state of the peer, starting (or retrying) a handshake when needed."""
        state = self._peers.get(addr)
        stale = (state is not None and state.status == "failed"
                 and self._clock() - state.failed_at >= self._retry_after)
        if state is None or stale:
            # A retry keeps the agent name: NIXL still holds that agent, and a PUSH_CANCEL
            # must still reach it (see `known_agent`).
            state = PeerState("pending", agent_name=state.agent_name if state else None)
            self._peers[addr] = state
            future = self._pool.submit(self._fetch, addr[0], addr[1])
            future.add_done_callback(lambda f, a=addr: self._on_done(a, f))
        return state

    def _on_done(self, addr: Address, future: Future) -> None:
        exc = future.exception()
        self._done.put((addr, None if exc else future.result(), exc))
        self._wake.set()

    def apply_finished(self) -> None:
        """Writer thread: turn finished handshakes into ready or failed peers."""
        while True:
            try:
                addr, meta, exc = self._done.get_nowait()
            except queue.Empty:
                return
            state = self._peers[addr]
            if exc is None:
                try:
                    state.agent_name = self._add_peer(meta, f"{addr[0]}:{addr[1]}")
                    state.engine_id = getattr(meta, "engine_id", None)
                    state.status = "ready"
                    logger.info("handshake with %s:%d done (%s)", *addr, state.agent_name)
                    continue
                except Exception as e:  # noqa: BLE001 - a bad peer must not kill the writer
                    exc = e
            state.status, state.reason, state.failed_at = "failed", str(exc), self._clock()
            logger.warning("handshake with %s:%d failed: %s", *addr, exc)

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

    def probe(self, addr: Address, on_result: Callable[[Address, bool], None]) -> None:
        """Liveness check on the executor; `on_result` runs there, so it must only enqueue."""
        def run() -> None:
            try:
                self._fetch(addr[0], addr[1])
                on_result(addr, True)
            except Exception:  # noqa: BLE001 - any failure means "not answering"
                on_result(addr, False)
            self._wake.set()
        self._pool.submit(run)

    def pending(self) -> bool:
        return any(s.status == "pending" for s in self._peers.values())

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
