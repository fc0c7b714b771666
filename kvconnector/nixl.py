"""A thin wrapper over one NIXL agent: the KV-cache region, per-peer descriptor lists, WRITE/READ
with completion notifications, standalone notifications.

Layout: the KV cache is ONE contiguous tensor ``[num_blocks, ...]``; block ``b`` is the byte range
``[base + b * bytes_per_block, + bytes_per_block)`` across every layer and K/V. Descriptor lists
with one entry per block are prepared once (local at construction, remote in :meth:`add_peer`);
a transfer picks entries by block id and NIXL merges entries that are consecutive on both sides,
so a transfer costs one descriptor per run of consecutive (local, remote) ids
(:func:`count_runs`; verified against NIXL telemetry in tests).

A peer of another tensor-parallel size holds other KV heads per block (its metadata says which:
`kvconnector.tp_layout`). Nothing is prepared for it: each transfer builds its descriptors,
one per (block, layer, K/V, token) run of the heads both hold (docs/design.md §8), so memory
stays proportional to the transfer, not to the peer's cache.

Progress: the agent runs WITHOUT NIXL's progress thread (it spins a core even when idle). A
transfer then only advances inside calls on this object, on BOTH agents (measured, nixl 1.5.1):
- the initiator polls :meth:`check` until DONE/ERR; over UCX_TLS=tcp an unpolled WRITE does not
  even move its bytes;
- the target polls :meth:`get_new_notifs` meanwhile: while it is idle the initiator stays at
  PROC indefinitely, even when CMA has already copied the bytes; the WRITE turns DONE on the
  initiator's next check after the target's first poll, and the completion is then delivered.
- a dead peer turns an in-flight transfer to ERR within milliseconds; later submissions and
  notifications to it raise :class:`TransferError` (NIXL_ERR_REMOTE_DISCONNECT).
Writer threads therefore poll while they have work and sleep otherwise (``get_new_notifs`` costs
~10 us per call; polling every 1 ms costs ~4 % of a core).

Threads: owned by the connector's transfer thread, which makes every transfer, notification and
peer call; the engine thread builds it, reads :meth:`local_metadata` and calls :meth:`shutdown`
once that thread stopped (docs/design.md §5). One lock serialises the agent calls, a guard for
that hand-over and for tests that drive one transport from several threads.

Fault injection (tests only) lives apart, in `kvconnector.faults` (`FaultyTransport`, a
subclass); `kvconnector.transport.make_transport` picks it when a ``fault_injection`` dict is
configured. Without one nothing of it is on the transfer path, and this module knows nothing
of it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvconnector.handshake import AgentMetadata
from kvconnector.tp_layout import HeadLayout, transfer_descs

logger = logging.getLogger(__name__)

__all__ = ["NixlTransport", "PeerConflict", "TransferError", "XferHandle", "count_runs"]


MAX_AGENT_BINDINGS = 4096


class TransferError(RuntimeError):
    """A transfer or notification could not be submitted; the message names the peer."""




class PeerConflict(TransferError):
    """A peer blob under an agent name bound to another side-channel address (`bound`)."""

    def __init__(self, message: str, name: str, bound: str | None) -> None:
        super().__init__(message)
        self.name, self.bound = name, bound


def count_runs(local_ids: Any, remote_ids: Any) -> int:
    """Descriptors a transfer needs: runs where both local and remote ids step by +1."""
    local, remote = np.asarray(local_ids, dtype=np.int64), np.asarray(remote_ids, dtype=np.int64)
    if local.size == 0:
        return 0
    breaks = (np.diff(local) != 1) | (np.diff(remote) != 1)
    return 1 + int(np.count_nonzero(breaks))


@dataclass(eq=False)
class XferHandle:
    """One submitted WRITE or READ. Owned by the transport; pass it back to check/release."""

    peer: str
    op: str
    nbytes: int
    descriptors: int
    submitted_at: float
    _nixl: Any = field(repr=False)
    _released: bool = False
    state: str = "PROC"  # last state NIXL reported


@dataclass
class _Peer:
    meta: AgentMetadata
    dlist: Any  # prepped remote descriptor list, one entry per remote block; None: other heads
    source: str | None = None  # side-channel "host:port" the metadata came from
    layout: HeadLayout | None = None  # set when the peer holds other heads (dlist is None)


def head_layout(meta: AgentMetadata) -> HeadLayout | None:
    """Where the rank behind `meta` keeps its heads, or None when its blob does not say."""
    if not (meta.num_layers and meta.kv_heads and meta.head_dim and meta.itemsize):
        return None
    return HeadLayout(meta.num_layers, meta.block_size, meta.kv_heads, meta.first_kv_head,
                      meta.total_kv_heads, meta.head_dim, meta.itemsize)


class NixlTransport:
    """One NIXL agent over one engine's KV cache. See the module docstring for the invariants."""

    def __init__(self, name: str, kv_cache: torch.Tensor, bytes_per_block: int,
                 backends: tuple[str, ...] | list[str] = ("UCX",),
                 *, engine_id: str = "",
                 block_size: int = 0, tp_rank: int = 0, tp_size: int = 1,
                 compat_hash: str = "", telemetry: bool = False,
                 layout: HeadLayout | None = None) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        if not kv_cache.is_contiguous() or kv_cache.dim() < 1:
            raise ValueError("kv_cache must be one contiguous tensor [num_blocks, ...]")
        nbytes = kv_cache.numel() * kv_cache.element_size()
        if bytes_per_block < 1 or kv_cache.shape[0] * bytes_per_block != nbytes:
            raise ValueError(f"bytes_per_block {bytes_per_block} does not match kv_cache "
                             f"{tuple(kv_cache.shape)} {kv_cache.dtype} ({nbytes} bytes)")
        if layout is not None and layout.bytes_per_block != bytes_per_block:
            raise ValueError(f"head layout {layout} has {layout.bytes_per_block} bytes per "
                             f"block, not {bytes_per_block}")
        self.layout = layout
        self.name = name
        self.kv_cache = kv_cache
        self.num_blocks = int(kv_cache.shape[0])
        self.bytes_per_block = bytes_per_block
        self.mem_type = "DRAM" if kv_cache.device.type == "cpu" else "VRAM"
        self.device_id = kv_cache.device.index or 0
        self._lock = threading.RLock()
        self._peers: dict[str, _Peer] = {}
        self.refused_peers = 0  # blobs refused for a name bound elsewhere (count_refused)
        # agent name -> the address it was first loaded from; outlives remove_peer (an idle
        # peer dropped must not free its name for an impostor) until `unbind` (the address
        # was found gone); bounded LRU
        self._bindings: OrderedDict[str, str | None] = OrderedDict()
        self._live: set[XferHandle] = set()
        self._closed = False

        config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                   backends=list(backends), capture_telemetry=telemetry)
        self._agent = nixl_agent(name, config)
        if not self._agent.backends:
            raise TransferError(f"NIXL agent {name}: none of the backends {list(backends)} "
                                f"is available (plugins: {self._agent.get_plugin_list()})")
        base = kv_cache.data_ptr()
        self._reg = self._agent.register_memory([(base, nbytes, self.device_id, "")],
                                                self.mem_type)
        self._local_dlist = self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _block_descs(base, self.num_blocks, bytes_per_block,
                                            self.device_id), self.mem_type)
        self._meta = AgentMetadata(
            agent_name=name, agent_blob=self._agent.get_agent_metadata(), base_addr=base,
            num_blocks=self.num_blocks, bytes_per_block=bytes_per_block, block_size=block_size,
            tp_rank=tp_rank, tp_size=tp_size, engine_id=engine_id, compat_hash=compat_hash,
            physical_blocks_per_logical=1, mem_type=self.mem_type, device_id=self.device_id,
            **_layout_fields(layout))

    # ------------------------------------------------------------ peers

    def local_metadata(self) -> AgentMetadata:
        return self._meta

    def add_peer(self, meta: AgentMetadata, source: str | None = None) -> str:
        """Load a peer's metadata and prepare its block descriptors. Idempotent per blob.

        ``source`` is the side-channel address ("host:port") the metadata came from. An agent
        name is bound to the first address it was loaded from: a blob for that name from
        another address raises :class:`PeerConflict` and the loaded peer stays — otherwise
        anyone serving a blob under a real engine's agent name (named in a PUSH_REG) would
        have our next WRITE for that engine land in its memory. The same address may replace
        the blob (a restart). The binding outlives an idle peer's removal, and ends only by
        :meth:`unbind`, once the caller found nobody serving that name at the bound address
        any more (`kvconnector.peers`): so whoever was loaded first — an impostor, a relay
        — cannot keep the real engine out after it has gone."""
        layout = self._other_heads(meta)
        if meta.physical_blocks_per_logical != 1 or (
                layout is None and meta.bytes_per_block != self.bytes_per_block):
            raise TransferError(
                f"peer {meta.agent_name} (engine {meta.engine_id!r}) has {meta.bytes_per_block} "
                f"bytes x {meta.physical_blocks_per_logical} per block; we have "
                f"{self.bytes_per_block} x 1")
        with self._lock:
            old = self._peers.get(meta.agent_name)
            if old is not None and old.meta.agent_blob == meta.agent_blob:
                return meta.agent_name
            bound = self._bindings.get(meta.agent_name, source)
            if source != bound:
                raise PeerConflict(
                    f"peer agent {meta.agent_name!r} (engine {meta.engine_id!r}) is bound to "
                    f"{bound or '?'}; refusing a different blob under that name from "
                    f"{source or '?'}", meta.agent_name, bound)
            if old is not None:
                self._remove_peer_locked(meta.agent_name)
            name = self._agent.add_remote_agent(meta.agent_blob)
            name = name.decode() if isinstance(name, bytes) else name
            if name != meta.agent_name:
                self._agent.remove_remote_agent(name)
                raise TransferError(f"peer metadata names agent {meta.agent_name!r} "
                                    f"but its blob is agent {name!r}")
            dlist = None if layout is not None else self._agent.prep_xfer_dlist(
                name, _block_descs(meta.base_addr, meta.num_blocks, meta.bytes_per_block,
                                   meta.device_id), meta.mem_type)
            self._peers[name] = _Peer(meta, dlist, source, layout)
            self._bindings[name] = source
            self._bindings.move_to_end(name)
            while len(self._bindings) > MAX_AGENT_BINDINGS:
                self._bindings.popitem(last=False)
        logger.info("NIXL %s: added peer %s (engine %r, %d blocks) from %s", self.name, name,
                    meta.engine_id, meta.num_blocks, source or "?")
        return name

    def _other_heads(self, meta: AgentMetadata) -> HeadLayout | None:
        """The peer's head layout when its blocks hold other heads than ours (transfers then
        move the heads both hold, `tp_layout`); None when whole blocks pair up."""
        theirs, ours = head_layout(meta), self.layout
        if theirs is None or ours is None or (theirs.heads, theirs.first_head) == (
                ours.heads, ours.first_head):
            return None
        dims = ("num_layers", "block_size", "total_heads", "head_dim", "itemsize")
        split = (all(getattr(theirs, d) == getattr(ours, d) for d in dims)
                 and theirs.bytes_per_block == meta.bytes_per_block
                 and theirs.heads * meta.tp_size == theirs.total_heads
                 and ours.heads * self._meta.tp_size == ours.total_heads)
        if not split:
            raise TransferError(
                f"peer {meta.agent_name} (engine {meta.engine_id!r}, TP {meta.tp_size}) holds "
                f"KV heads [{theirs.first_head}, {theirs.first_head + theirs.heads}) of "
                f"{theirs.total_heads} in {meta.bytes_per_block}-byte blocks; we (TP "
                f"{self._meta.tp_size}) hold [{ours.first_head}, {ours.first_head + ours.heads})"
                f" of {ours.total_heads}: not a split of the same model's heads we can pair "
                f"(KV heads replicated over ranks pair only between equal TP sizes)")
        return theirs

    def unbind(self, name: str, source: str | None) -> None:
        """Nobody serves `name` at `source` any more: free the name (and drop the agent if it
        is still loaded from there), so the next blob under it binds afresh."""
        with self._lock:
            if self._bindings.get(name) != source:
                return
            del self._bindings[name]
            peer = self._peers.get(name)
            if peer is not None and peer.source == source:
                self._remove_peer_locked(name)
        logger.info("NIXL %s: agent name %s no longer bound to %s (gone)", self.name, name,
                    source or "?")

    def count_refused(self, conflict: PeerConflict) -> None:
        """A blob finally refused for a name bound elsewhere (`kv_refused_peers_total`)."""
        with self._lock:
            self.refused_peers += 1
        logger.warning("NIXL %s: %s", self.name, conflict)

    def remove_peer(self, name: str) -> None:
        with self._lock:
            self._remove_peer_locked(name)

    def _remove_peer_locked(self, name: str) -> None:
        peer = self._peers.pop(name, None)
        if peer is None:
            return
        if peer.dlist is not None:  # None: a peer of another TP size (nothing prepped)
            _quiet(peer.dlist.release, f"release dlist of {name}")
        _quiet(lambda: self._agent.remove_remote_agent(name), f"remove agent {name}")

    def peers(self) -> list[str]:
        with self._lock:
            return list(self._peers)

    # ------------------------------------------------------------ transfers

    def write(self, peer: str, local_block_ids: list[int], remote_block_ids: list[int],
              notif: bytes = b"") -> XferHandle:
        """WRITE local blocks into the peer's blocks; ``notif`` reaches the peer once landed."""
        return self._submit("WRITE", peer, local_block_ids, remote_block_ids, notif)

    def read(self, peer: str, local_block_ids: list[int], remote_block_ids: list[int],
             notif: bytes = b"") -> XferHandle:
        """READ the peer's blocks into local blocks; ``notif`` tells the peer when done."""
        return self._submit("READ", peer, local_block_ids, remote_block_ids, notif)

    def _submit(self, op: str, peer_name: str, local_ids: list[int], remote_ids: list[int],
                notif: bytes) -> XferHandle:
        local = np.asarray(local_ids, dtype=np.int64)
        remote = np.asarray(remote_ids, dtype=np.int64)
        with self._lock:
            peer = self._peers.get(peer_name)
            if peer is None:
                raise TransferError(f"{op} to unknown peer {peer_name!r} (no handshake yet)")
            _check_ids(local, self.num_blocks, f"local ({self.name})")
            _check_ids(remote, peer.meta.num_blocks, f"remote ({peer_name})")
            if local.size != remote.size or local.size == 0:
                raise ValueError(f"{op} to {peer_name}: {local.size} local vs {remote.size} "
                                 f"remote block ids (need equal, non-zero)")
            try:
                handle = self._create(op, peer_name, peer, local, remote, notif)
            except Exception as e:
                raise TransferError(f"{op} to {peer_name}: cannot create transfer: {e}") from e
            self._post(handle)
            self._live.add(handle)
            return handle

    def _post(self, handle: XferHandle) -> None:
        """Start a created transfer (lock held); TransferError, and nothing left, if refused."""
        xfer = handle._nixl
        try:
            state = self._agent.transfer(xfer)
        except Exception as e:  # e.g. nixlRemoteDisconnectError: the peer died
            state, detail = "ERR", f"{type(e).__name__}: {e}"
        else:
            detail = "NIXL returned ERR"
        if state == "ERR":
            _quiet(xfer.release, f"release failed {handle.op} to {handle.peer}")
            raise TransferError(f"{handle.op} to {handle.peer}: submission failed: {detail}")
        handle.state = state

    def _create(self, op: str, name: str, peer: _Peer, local: np.ndarray, remote: np.ndarray,
                notif: bytes) -> XferHandle:
        """The NIXL transfer: prepped whole blocks, or this transfer's head-range runs."""
        if peer.layout is None:
            xfer = self._agent.make_prepped_xfer(op, self._local_dlist, local.astype(np.int32),
                                                 peer.dlist, remote.astype(np.int32), notif)
            return XferHandle(name, op, int(local.size) * self.bytes_per_block,
                              count_runs(local, remote), time.monotonic(), xfer)
        assert self.layout is not None
        mine, theirs = transfer_descs(self.layout, self._meta.base_addr, local, self.device_id,
                                      peer.layout, peer.meta.base_addr, remote,
                                      peer.meta.device_id)
        xfer = self._agent.initialize_xfer(
            op, self._agent.get_xfer_descs(mine, self.mem_type),
            self._agent.get_xfer_descs(theirs, peer.meta.mem_type), name, notif)
        return XferHandle(name, op, int(mine[:, 1].sum()), len(mine), time.monotonic(), xfer)

    def check(self, handle: XferHandle) -> str:
        """"DONE", "PROC" or "ERR". Drives progress on this side; call until not "PROC"."""
        with self._lock:
            if handle.state == "PROC" and not handle._released:
                try:
                    handle.state = self._agent.check_xfer_state(handle._nixl)
                except Exception as e:
                    logger.warning("NIXL %s: %s to %s failed: %s", self.name, handle.op,
                                   handle.peer, e)
                    handle.state = "ERR"
            return handle.state

    def release(self, handle: XferHandle) -> bool:
        """Free a finished transfer. Returns False, and frees nothing, while it is in flight.

        An in-flight WRITE is never cancelled here: NIXL's cancel does not undo bytes that CMA
        already copied, and over a network they may still land. A transfer is over only once
        :meth:`check` says DONE or ERR (the point where PUSH_CANCEL_ACK may be sent)."""
        with self._lock:
            if handle._released:
                return True
            if self.check(handle) == "PROC":
                return False
            try:
                handle._nixl.release()
            except Exception as e:  # kept in _live; shutdown() tries again
                logger.warning("NIXL %s: cannot release %s to %s: %s", self.name,
                               handle.op, handle.peer, e)
                return False
            handle._released = True
            self._live.discard(handle)
            return True

    # ------------------------------------------------------------ notifications

    def send_notif(self, peer_name: str, msg: bytes) -> None:
        """Send a standalone notification. Raises TransferError naming the peer on failure."""
        with self._lock:
            if peer_name not in self._peers:
                raise TransferError(f"notification to unknown peer {peer_name!r} "
                                    "(no handshake yet)")
            try:
                self._agent.send_notif(peer_name, bytes(msg))
            except Exception as e:
                raise TransferError(f"notification to {peer_name} failed: {e}") from e

    def get_new_notifs(self) -> list[tuple[str, bytes]]:
        """Drain received notifications as (sender agent name, message), oldest first per peer.

        Also drives this agent's progress (the target side of a transfer must call it)."""
        with self._lock:
            got = self._agent.get_new_notifs()
        return [(str(name), bytes(m)) for name, msgs in got.items() for m in msgs]

    # ------------------------------------------------------------ teardown

    def telemetry_descriptors(self, handle: XferHandle) -> int:
        """Descriptors NIXL actually used (needs ``telemetry=True``)."""
        with self._lock:
            return int(self._agent.get_xfer_telemetry(handle._nixl).descCount)

    def shutdown(self) -> None:
        """Release every transfer, peer and registration. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for handle in list(self._live):
                _quiet(handle._nixl.release, f"release {handle.op} to {handle.peer}")
            self._live.clear()
            for name in list(self._peers):
                self._remove_peer_locked(name)
            _quiet(self._local_dlist.release, "release local dlist")
            _quiet(lambda: self._agent.deregister_memory(self._reg), "deregister KV cache")


def _layout_fields(layout: HeadLayout | None) -> dict[str, int]:
    if layout is None:
        return {}
    return {"num_layers": layout.num_layers, "kv_heads": layout.heads,
            "first_kv_head": layout.first_head, "total_kv_heads": layout.total_heads,
            "head_dim": layout.head_dim, "itemsize": layout.itemsize}


def _block_descs(base: int, num_blocks: int, bytes_per_block: int, device_id: int) -> np.ndarray:
    descs = np.empty((num_blocks, 3), dtype=np.uint64)
    descs[:, 0] = base + np.arange(num_blocks, dtype=np.uint64) * np.uint64(bytes_per_block)
    descs[:, 1] = bytes_per_block
    descs[:, 2] = device_id
    return descs


def _check_ids(ids: np.ndarray, num_blocks: int, side: str) -> None:
    if ids.ndim != 1 or (ids.size and (ids.min() < 0 or ids.max() >= num_blocks)):
        raise ValueError(f"{side} block ids out of range [0, {num_blocks})")


def _quiet(fn: Any, what: str) -> None:
    try:
        fn()
    except Exception as e:  # teardown continues past one failed step
        logger.warning("NIXL teardown: %s failed: %s", what, e)
