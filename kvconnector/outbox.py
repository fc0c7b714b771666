"""Notifications waiting for a peer: sent once the handshake with its address is over.

Owned by the transfer thread (through the half that holds it). A message queued for an
address whose handshake is pending waits; one for a ready peer is sent; one for a failed
peer, or whose send raises, is dropped with a log line (the sender's protocol has a deadline
that covers a lost notification). With `agent`, a message goes out only if the address
still serves that NIXL agent; otherwise it is refused (counted by `flush`'s caller) so a
reply never reaches another process that took over the address. At most `limit` messages
wait; the oldest go first (reported to `on_drop`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvconnector import wire
from kvconnector.peers import Address, Peers

logger = logging.getLogger(__name__)


class Outbox:
    def __init__(self, transport: Any, peers: Peers, limit: int | None = None,
                 on_drop: Callable[[int], None] | None = None) -> None:
        self.t = transport
        self.peers = peers
        self.limit = limit
        self.on_drop = on_drop
        self.items: list[tuple[Address, bytes, str | None]] = []

    def __len__(self) -> int:
        return len(self.items)

    def addresses(self) -> set[Address]:
        return {addr for addr, *_ in self.items}

    def send(self, addr: Address, msg: bytes, agent: str | None = None) -> int:
        """Queue `msg` for `addr` and flush; returns how many messages were refused."""
        self.items.append((addr, msg, agent))
        refused = self.flush()
        if self.limit is not None and len(self.items) > self.limit:
            dropped = len(self.items) - self.limit
            if self.on_drop is not None:
                self.on_drop(dropped)
            logger.warning("outbox full: dropped the %d oldest notifications", dropped)
            self.items = self.items[dropped:]
        return refused

    def flush(self) -> int:
        """Send what can go; returns how many messages were refused (wrong agent)."""
        keep, refused = [], 0
        for addr, msg, agent in self.items:
            peer = self.peers.get(addr)
            if peer.status == "pending":
                keep.append((addr, msg, agent))
                continue
            kind = wire.notif_kind(msg)
            if peer.status == "ready" and agent is not None and peer.agent_name != agent:
                refused += 1
                logger.warning("%s to %s:%d dropped: that address serves agent %s, the "
                               "transfer belongs to %s", kind, *addr, peer.agent_name, agent)
                continue
            if peer.status == "ready":
                try:
                    self.t.send_notif(peer.agent_name, msg)
                    continue
                except Exception as e:  # noqa: BLE001 - the protocol's deadline covers it
                    logger.warning("%s to %s:%d failed: %s", kind, *addr, e)
            logger.warning("%s to unreachable %s:%d dropped", kind, *addr)
        self.items = keep
        return refused
