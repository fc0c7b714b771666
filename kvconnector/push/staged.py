"""What P's push thread holds (plain data, owned by the push thread): a P request's staged
blocks and its state, D's pending registrations, the WRITEs in flight, and the rules that
pair a registration with a P request (`match_rank`, `digest_ok`, `tomb_key`).

`Sender` (sender.py) drives them; docs/design.md §6 draws the machine.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvconnector import transfer_hist, wire
from kvconnector.push.meta import FinishedBlocks

if TYPE_CHECKING:
    from kvconnector.nixl import XferHandle

RegKey = tuple[str, int]  # (D request id, D's TP rank): one registration per D rank


def reg_key(reg: wire.PushReg) -> RegKey:
    return (reg.request_id, reg.decode_tp_rank)


class SendState(enum.Enum):
    """Where one P request's staged blocks stand (docs/design.md §6 draws the machine)."""

    STAGED = "staged"  # under lease, no registration matched yet (or the next D rank's)
    MATCHED = "matched"  # paired with registrations `matched`; their WRITEs wait for D's peer
    WRITING = "writing"  # a WRITE is posted (`writes`), not over yet (more may be matched)


@dataclass
class PendingReg:
    reg: wire.PushReg  # as decoded from D's notification
    received_at: float
    agent: str | None = None  # the NIXL agent it came from (None: not checked)
    # P's clock by which a P request must carry its transfer (None: one does, or no check)
    claim_by: float | None = None

    @property
    def addr(self) -> tuple[str, int]:
        return (self.reg.decode_host, self.reg.decode_port)


@dataclass
class Inflight:
    p_request_id: str
    reg: PendingReg
    handle: XferHandle  # the transport's, for check() and release()
    started: float
    nbytes: int
    ack_cancel: bool = False


@dataclass
class Staged:
    """One P request whose blocks are under lease; it ends (`done`) when they may be freed."""

    blocks: FinishedBlocks
    lease_deadline: float
    state: SendState = SendState.STAGED
    matched: list[RegKey] = field(default_factory=list)  # paired, WRITE not posted yet
    match_seq: int = 0  # WRITEs are posted in match order
    writes: dict[int, Inflight] = field(default_factory=dict)  # D rank -> its WRITE in flight
    expected: int = 1  # D ranks to write (those holding this rank's heads), set at a match
    written: set[int] = field(default_factory=set)  # D ranks whose WRITE is DONE
    failed: bool = False  # given up while a WRITE was in flight: freed once it is over

    def busy_ranks(self) -> set[int]:
        """D ranks written, being written or matched."""
        return self.written | self.writes.keys() | {k[1] for k in self.matched}

    def takes(self, d_rank: int) -> bool:
        """Whether a registration of D rank `d_rank` may still pair with these blocks."""
        busy = self.busy_ranks()
        return not self.failed and d_rank not in busy and len(busy) < self.expected


@dataclass
class SenderStats:
    counters: dict[str, float] = field(default_factory=lambda: {
        "kv_push_registrations_received_total": 0, "kv_push_writes_total": 0,
        "kv_push_write_failures_total": 0, "kv_transfer_bytes_total": 0, **transfer_hist.initial(),
        "kv_lease_expired_total": 0, "kv_push_fail_sent_total": 0,
        "kv_push_registrations_refused_total": 0, "kv_notifs_dropped_total": 0,
        "kv_push_digest_mismatch_total": 0, "kv_push_unknown_transfer_total": 0,
    })

    def add(self, name: str, value: float = 1) -> None:
        self.counters[name] += value


def match_rank(fb: FinishedBlocks, reg: wire.PushReg) -> int | None:
    """Whether P request `fb` and registration `reg` name the same transfer: 0 by transfer id,
    1 by exact request id, 2 by base request id (lower is better); None if they do not. A
    transfer id on either side admits only an equal transfer id."""
    if fb.transfer_id or reg.transfer_id:
        return 0 if fb.transfer_id == reg.transfer_id else None
    if fb.request_id == reg.request_id:
        return 1
    if wire.base_request_id(fb.request_id) == wire.base_request_id(reg.request_id):
        return 2
    return None


def digest_ok(fb: FinishedBlocks, reg: wire.PushReg) -> bool:
    """Registration and P's prompt are the same tokens (an empty digest matches nothing)."""
    return bool(fb.prompt_digest) and fb.prompt_digest == reg.prompt_digest


def tomb_key(transfer_id: str | None, request_id: str) -> str:
    """Tombstones of the two match kinds live apart: a request id never refuses a transfer
    that has a transfer id, nor the reverse."""
    return f"t:{transfer_id}" if transfer_id else f"r:{wire.base_request_id(request_id)}"
