"""Engines played by the test process: a real NIXL agent over a zeroed KV cache, a real side
channel, and a named thread that drains its notifications (which also drives the agent's
progress: a WRITE into it only completes while it is polled).

Used to stand in for a P or a D (so the test learns the ids a real engine keeps to itself),
for a stranger sending notifications, or for an impostor serving a blob under a real
engine's agent name.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from fault_kit import wait_for

from kvconnector import wire
from kvconnector.handshake import AgentMetadata, SideChannelServer, fetch_peer_metadata
from kvconnector.nixl import NixlTransport
from kvconnector.security import KVSecurity

NUM_BLOCKS = 64
POLL_S = 0.001


class FakeEngine:
    def __init__(self, agent_name: str, like: AgentMetadata,
                 security: KVSecurity | None = None) -> None:
        """`like`: a real engine's metadata, whose block size and compat hash we copy."""
        self.cache = torch.zeros((NUM_BLOCKS, like.bytes_per_block // 4), dtype=torch.float32)
        self.t = NixlTransport(agent_name, self.cache, like.bytes_per_block,
                               engine_id=agent_name.split("-")[0], block_size=like.block_size,
                               compat_hash=like.compat_hash)
        self.side = SideChannelServer("127.0.0.1", 0, self.t.local_metadata, security).start()
        self.got: list[tuple[str, Any]] = []  # (sender agent, decoded notification)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True,
                                        name=f"fake-{agent_name}-notifs")
        self._thread.start()

    @property
    def name(self) -> str:
        return self.t.name

    def load(self, port: int) -> str:
        """Handshake with the engine whose side channel is on `port`; its agent name."""
        meta = fetch_peer_metadata("127.0.0.1", port, None, 5.0)
        return self.t.add_peer(meta, f"127.0.0.1:{port}")

    def send(self, agent: str, msg: bytes) -> None:
        self.t.send_notif(agent, msg)

    def wait_for_notif(self, kind: type, timeout: float = 20.0, **fields: Any
                       ) -> tuple[str, Any]:
        def find() -> tuple[str, Any] | None:
            with self._lock:
                for agent, msg in self.got:
                    if isinstance(msg, kind) and all(getattr(msg, k) == v
                                                     for k, v in fields.items()):
                        return agent, msg
            return None
        return wait_for(find, timeout, f"{self.name} to receive {kind.__name__} {fields}")

    def untouched(self) -> bool:
        return not bool(self.cache.any())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.side.stop()
        self.t.shutdown()

    def _poll(self) -> None:
        while not self._stop.wait(POLL_S):
            for agent, raw in self.t.get_new_notifs():
                msg = wire.decode_notif(raw)
                with self._lock:
                    self.got.append((agent, msg))
