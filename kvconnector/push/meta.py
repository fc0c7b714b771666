"""What the push scheduler half hands the worker half(s) each step: `PushMeta`, a tagged
msgspec struct (engine/connector_seam.py), so a TP rank decodes it typed."""

from __future__ import annotations

from dataclasses import dataclass

from engine.connector_seam import KVConnectorMetadata
from kvconnector.wire import FirstToken, base_request_id


def heartbeat_id(request_id: str, transfer_id: str | None) -> str:
    """What D's heartbeat names a transfer by, and P's lease is found by: the transfer id, or
    the base request id (engine suffix stripped) of a transfer without one."""
    return transfer_id or base_request_id(request_id)


@dataclass(frozen=True)
class Registration:
    """D side: blocks D preallocated for a prompt, to be registered with P."""

    request_id: str
    transfer_id: str  # "" = none: P matches by request id (and prompt digest)
    local_block_ids: list[int]  # D's ids for prompt blocks first_block_index, ...
    first_block_index: int
    num_prompt_tokens: int
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_tp_size: int
    prompt_digest: str = ""  # security.prompt_digest of the whole prompt
    first_token: bool = False  # ask P for the token it sampled (kvconnector/seed.py)

    @property
    def hb_id(self) -> str:
        return heartbeat_id(self.request_id, self.transfer_id)


@dataclass(frozen=True)
class Queued:
    """D side: a remote-prefill request that waits in D's queue before its blocks exist."""

    request_id: str
    transfer_id: str  # "" = none
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_tp_size: int = 1

    @property
    def hb_id(self) -> str:
        return heartbeat_id(self.request_id, self.transfer_id)


@dataclass(frozen=True)
class FinishedBlocks:
    """P side: a finished prefill's prompt blocks, to be written into D under a lease."""

    request_id: str
    transfer_id: str | None
    block_ids: list[int]  # every prompt block, in prompt order
    num_prompt_tokens: int
    prompt_digest: str = ""  # security.prompt_digest of P's prompt; a PUSH_REG must equal it
    first_token: FirstToken | None = None  # what P sampled, for a registration that asks


class PushMeta(KVConnectorMetadata):
    registrations: list[Registration] = []  # D: send PUSH_REG
    queued: list[Queued] = []  # D: heartbeat P while queued
    watchdog_expired: list[str] = []  # D: give up, cancel at P
    released: list[str] = []  # D: request over; free when safe
    finished_blocks: list[FinishedBlocks] = []  # P: write these
    aborted: list[tuple[str, str | None]] = []  # P: (id, transfer)
    # P: (id, transfer) of each P leg that entered the scheduler; it ends in finished_blocks
    # or aborted. A registration for a transfer no such request carries is refused soon.
    arrived: list[tuple[str, str | None]] = []

    def brings_work(self) -> bool:
        return bool(self.registrations or self.queued or self.watchdog_expired or self.released
                    or self.finished_blocks or self.aborted or self.arrived)
