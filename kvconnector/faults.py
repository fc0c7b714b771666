"""Test-only fault injection around a NIXL transport: `FaultyTransport`.

Built only when a ``fault_injection`` dict is configured (``kv_connector_extra_config``, or
the ``fault_injection`` argument of `NixlTransport`, which then builds this subclass); the
transport every engine otherwise runs has none of this on its path. Keys:
- ``drop_notif``: list of kinds whose outgoing notifications vanish: ``PUSH_REG``, ``PUSH_FAIL``,
  ``PUSH_CANCEL``, ``PUSH_CANCEL_ACK``, ``HB`` (standalone) or ``COMPLETION`` (the notification
  that rides on a WRITE/READ; the data still moves).
- ``delay_notif``: ``{kind: seconds}`` — the notification is held back and goes out on the first
  call to this transport (``get_new_notifs``, ``check``, ``send_notif``) after the delay (a
  delayed COMPLETION goes out once its transfer is DONE and the delay has passed).
- ``fail_write`` / ``fail_read``: true — submission raises `TransferError`.
- ``fail_handshake``: true — `add_peer` raises `HandshakeError`.
- ``delay_write_completion_s``: `check` reports "PROC" until this long after submission.
- ``delay_write_s``: a WRITE is posted this long after its submission (`check` says "PROC"
  until then): its bytes and its completion land late, as over a slow network.
- ``probability`` (default 1.0) and ``seed``: each listed fault fires per operation with this
  probability from a seeded RNG (soak tests). ``max_faults``: stop injecting after this many.
- ``by_rank``: ``{tp_rank: {key: value}}`` — what the transport of that tensor-parallel rank
  injects on top of (replacing) the keys above, so a test can make one rank of a TP engine fail
  or stall while the others work: ``{"by_rank": {"1": {"fail_write": true}}}``.
Injected faults are counted in ``fault_counts`` by name.

Threads: as `NixlTransport` (the transfer thread; its lock guards the delayed notifications).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

from kvconnector import wire
from kvconnector.handshake import AgentMetadata, HandshakeError
from kvconnector.nixl import NixlTransport, TransferError, XferHandle

logger = logging.getLogger(__name__)

_NOTIF_KINDS = (*wire.TAGS, wire.COMPLETION)


@dataclass(frozen=True)
class FaultInjection:
    """Parsed ``fault_injection`` dict (see the module docstring). Unknown keys are an error."""

    drop_notif: frozenset[str] = frozenset()
    delay_notif: dict[str, float] = field(default_factory=dict)
    fail_write: bool = False
    fail_read: bool = False
    fail_handshake: bool = False
    delay_write_completion_s: float = 0.0
    delay_write_s: float = 0.0
    probability: float = 1.0
    seed: int | None = None
    max_faults: int | None = None

    def __post_init__(self) -> None:
        for kind in (*self.drop_notif, *self.delay_notif):
            if kind not in _NOTIF_KINDS:
                raise ValueError(f"fault_injection: unknown notification kind {kind!r}; "
                                 f"known: {', '.join(_NOTIF_KINDS)}")
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"fault_injection: probability must be in [0, 1]: {self.probability}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FaultInjection:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"fault_injection: unknown key(s) {', '.join(unknown)}")
        data = dict(data)
        data["drop_notif"] = frozenset(data.get("drop_notif", ()))
        data["delay_notif"] = {k: float(v) for k, v in dict(data.get("delay_notif", {})).items()}
        return cls(**data)


def for_rank(fault_injection: dict[str, Any], tp_rank: int) -> dict[str, Any]:
    """The faults tensor-parallel rank `tp_rank` injects: the top level, `by_rank` over it."""
    faults = dict(fault_injection)
    by_rank = dict(faults.pop("by_rank", {}))
    if not all(str(r).isdigit() and isinstance(v, dict) for r, v in by_rank.items()):
        raise ValueError(f"fault_injection: by_rank maps tensor-parallel ranks to fault "
                         f"dicts, got {by_rank!r}")
    return {**faults, **by_rank.get(str(tp_rank), by_rank.get(tp_rank, {}))}


class FaultyTransport(NixlTransport):
    """`NixlTransport` with the faults of a ``fault_injection`` dict injected."""

    def __init__(self, name: str, kv_cache: Any, bytes_per_block: int,
                 backends: tuple[str, ...] | list[str] = ("UCX",),
                 fault_injection: dict[str, Any] | None = None, **kw: Any) -> None:
        self.faults = FaultInjection.from_dict(for_rank(fault_injection or {},
                                                        kw.get("tp_rank", 0)))
        self.fault_counts: dict[str, int] = {}
        self._rng = random.Random(self.faults.seed)
        self._delayed: list[tuple[float, str, bytes]] = []  # (due, peer, notification)
        self._deferred: dict[XferHandle, tuple[bytes, float]] = {}  # delayed completions
        self._ready_at: dict[XferHandle, float] = {}  # injected completion delay
        self._postponed: dict[XferHandle, float] = {}  # WRITEs not posted yet: when they are
        super().__init__(name, kv_cache, bytes_per_block, backends, **kw)

    def add_peer(self, meta: AgentMetadata, source: str | None = None) -> str:
        if self._inject("fail_handshake", self.faults.fail_handshake):
            raise HandshakeError(meta.agent_name, "injected fault", "fail_handshake")
        return super().add_peer(meta, source)

    def _submit(self, op: str, peer_name: str, local_ids: list[int], remote_ids: list[int],
                notif: bytes) -> XferHandle:
        with self._lock:
            flag = self.faults.fail_write if op == "WRITE" else self.faults.fail_read
            if self._inject(f"fail_{op.lower()}", flag):
                raise TransferError(f"{op} to {peer_name}: injected submission failure")
            sent, delay = notif, 0.0
            if notif and self._inject("drop_notif:COMPLETION",
                                      wire.COMPLETION in self.faults.drop_notif):
                sent = b""
            elif notif:
                delay = self.faults.delay_notif.get(wire.COMPLETION, 0.0)
                if self._inject("delay_notif:COMPLETION", delay > 0):
                    sent = b""
            handle = super()._submit(op, peer_name, local_ids, remote_ids, sent)
            if notif and not sent and delay > 0:
                self._deferred[handle] = (notif, handle.submitted_at + delay)
            if self._inject("delay_write_completion", self.faults.delay_write_completion_s > 0):
                self._ready_at[handle] = (handle.submitted_at
                                          + self.faults.delay_write_completion_s)
            return handle

    def _post(self, handle: XferHandle) -> None:
        if handle.op == "WRITE" and self._inject("delay_write", self.faults.delay_write_s > 0):
            self._postponed[handle] = handle.submitted_at + self.faults.delay_write_s
            return  # "PROC" until `check` posts it
        super()._post(handle)

    def _post_due(self, handle: XferHandle) -> bool:
        """Post a postponed WRITE once due (lock held); False while it still waits."""
        due = self._postponed.get(handle)
        if due is None:
            return True
        if time.monotonic() < due:
            return False
        del self._postponed[handle]
        try:
            super()._post(handle)
        except TransferError as e:  # `_post` released it: nothing left to release
            logger.warning("NIXL %s: postponed %s", self.name, e)
            handle.state, handle._released = "ERR", True
            self._live.discard(handle)
        return True

    def check(self, handle: XferHandle) -> str:
        with self._lock:
            self._flush()
            if not self._post_due(handle):
                return "PROC"
            state = super().check(handle)
            if state != "PROC" and handle in self._deferred:
                notif, due = self._deferred.pop(handle)
                if state == "DONE":  # a failed transfer delivers no completion
                    self._delayed.append((due, handle.peer, notif))
                    self._flush()
            if state == "DONE" and time.monotonic() < self._ready_at.get(handle, 0.0):
                return "PROC"
            if state != "PROC":
                self._ready_at.pop(handle, None)
            return state

    def send_notif(self, peer_name: str, msg: bytes) -> None:
        with self._lock:
            self._flush()
            kind = wire.notif_kind(msg)
            if self._inject(f"drop_notif:{kind}", kind in self.faults.drop_notif):
                return
            delay = self.faults.delay_notif.get(kind, 0.0)
            if self._inject(f"delay_notif:{kind}", delay > 0):
                self._delayed.append((time.monotonic() + delay, peer_name, bytes(msg)))
                return
            super().send_notif(peer_name, msg)

    def get_new_notifs(self) -> list[tuple[str, bytes]]:
        with self._lock:
            self._flush()
        return super().get_new_notifs()

    def _flush(self) -> None:
        """Send the delayed notifications that are due (lock held)."""
        if not self._delayed:
            return
        now = time.monotonic()
        due = [d for d in self._delayed if d[0] <= now]
        self._delayed = [d for d in self._delayed if d[0] > now]
        for _, peer_name, msg in due:
            try:
                super().send_notif(peer_name, msg)
            except TransferError as e:
                logger.warning("NIXL %s: delayed notification lost: %s", self.name, e)

    def _inject(self, fault: str, armed: Any) -> bool:
        if not armed:
            return False
        total = sum(self.fault_counts.values())
        if self.faults.max_faults is not None and total >= self.faults.max_faults:
            return False
        if self.faults.probability < 1.0 and self._rng.random() >= self.faults.probability:
            return False
        self.fault_counts[fault] = self.fault_counts.get(fault, 0) + 1
        logger.warning("NIXL %s: injecting fault %s", self.name, fault)
        return True
