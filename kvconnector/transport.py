"""The transport the connector halves drive, as a type, and the one place that builds it.

`Transport` is what the transfer thread and the mode halves call (docs/design.md §5): one
agent over one engine's KV cache, its peers, WRITE/READ, and notifications. `NixlTransport`
(kvconnector/nixl.py) is the one implementation engines run; `FaultyTransport`
(kvconnector/faults.py, tests only) subclasses it with injected faults.

`make_transport` is how a worker half gets one: with a ``fault_injection`` dict configured
(``kv_connector_extra_config.fault_injection``) the faulty subclass, otherwise the plain one.
It sits above both modules, so the transport never names its test double.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from kvconnector.faults import FaultyTransport
from kvconnector.nixl import NixlTransport, PeerConflict, XferHandle

if TYPE_CHECKING:
    from kvconnector.handshake import AgentMetadata


class Transport(Protocol):
    """One agent over one engine's KV cache. Called from the transfer thread only, except
    `local_metadata` and `shutdown` (engine-core thread, before it starts / after it stops)."""

    name: str
    num_blocks: int
    bytes_per_block: int
    refused_peers: int  # agent blobs refused for a name bound to another address

    def local_metadata(self) -> AgentMetadata: ...
    def add_peer(self, meta: AgentMetadata, source: str | None = None) -> str: ...
    def unbind(self, name: str, source: str | None) -> None: ...
    def count_refused(self, conflict: PeerConflict) -> None: ...
    def remove_peer(self, name: str) -> None: ...
    def peers(self) -> list[str]: ...
    def write(self, peer: str, local_block_ids: list[int], remote_block_ids: list[int],
              notif: bytes = b"") -> XferHandle: ...
    def read(self, peer: str, local_block_ids: list[int], remote_block_ids: list[int],
             notif: bytes = b"") -> XferHandle: ...
    def check(self, handle: XferHandle) -> str: ...
    def release(self, handle: XferHandle) -> bool: ...
    def send_notif(self, peer_name: str, msg: bytes) -> None: ...
    def get_new_notifs(self) -> list[tuple[str, bytes]]: ...
    def shutdown(self) -> None: ...


def make_transport(name: str, kv_cache: Any, bytes_per_block: int,
                   backends: tuple[str, ...] | list[str] = ("UCX",),
                   fault_injection: dict[str, Any] | None = None, **kw: Any) -> NixlTransport:
    """A transport over `kv_cache` (one contiguous tensor [num_blocks, ...]) named `name`;
    with `fault_injection` (tests) the `FaultyTransport` that injects it. `kw`: the
    `NixlTransport` keywords (engine_id, block_size, tp_rank, tp_size, compat_hash,
    telemetry, layout)."""
    if fault_injection:
        return FaultyTransport(name, kv_cache, bytes_per_block, backends, fault_injection, **kw)
    return NixlTransport(name, kv_cache, bytes_per_block, backends, **kw)
