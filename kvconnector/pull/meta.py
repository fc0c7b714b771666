"""What the pull scheduler half hands the worker half each step (`PullMeta`, a tagged msgspec
struct: engine/connector_seam.py), and the prompt digest both sides compute."""

from __future__ import annotations

from dataclasses import dataclass

from engine.connector_seam import KVConnectorMetadata

# P puts the digest of the prompt it prefilled in its kv_transfer_params; D reads P's blocks
# only for a prompt with the same digest, so params that reach the wrong prompt (a prompt
# list, a client replaying them) never load someone else's KV. One digest for the KV path.
from kvconnector.security import prompt_digest as prompt_digest

Address = tuple[str, int]


@dataclass(frozen=True)
class Claim:
    """D side: a request that will read P's blocks; D heartbeats P until the READ is over."""

    request_id: str  # D's
    remote_request_id: str  # P's: the id in HB and in the completion notification
    remote_engine_id: str
    remote_host: str
    remote_port: int

    @property
    def addr(self) -> Address:
        return (self.remote_host, self.remote_port)


@dataclass(frozen=True)
class Read:
    """D side: READ P's blocks `remote_block_ids` into D's `local_block_ids` (same order;
    prompt blocks `first_block_index`, ...)."""

    claim: Claim
    local_block_ids: list[int]
    remote_block_ids: list[int]
    first_block_index: int


@dataclass(frozen=True)
class Lease:
    """P side: a finished prefill's prompt blocks, held for D to read."""

    request_id: str
    block_ids: list[int]


class PullMeta(KVConnectorMetadata):
    claims: list[Claim] = []  # D: heartbeat while queued
    reads: list[Read] = []  # D: post these READs
    released: list[str] = []  # D: request over, blocks held
    abandoned: list[str] = []  # D: claim dropped before any READ
    leases: list[Lease] = []  # P: hold these for D

    def brings_work(self) -> bool:
        return bool(self.claims or self.reads or self.released or self.abandoned
                    or self.leases)
