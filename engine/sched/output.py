"""What the scheduler hands the model runner each step (what comes back, `ModelRunnerOutput`,
is in engine/runner_output.py).

New requests travel whole (`NewRequestData`); requests the runner already holds travel as
deltas (`CachedRequestData`: only newly allocated blocks and the computed-token count).
A preempted request is dropped by the runner (`preempted_req_ids`) and, when it is
scheduled again, travels whole once more with every token it has so far.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from engine.connector_seam import KVConnectorMetadata
from engine.protocol import SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    token_ids: list[int]  # prompt + outputs generated so far (non-empty after a preemption)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None = None


@dataclass
class CachedRequestData:
    req_id: str
    new_block_ids: list[int]  # blocks appended to the request's block table this step
    num_computed_tokens: int


M = TypeVar("M", bound=KVConnectorMetadata)


@dataclass
class SchedulerOutput(Generic[M]):
    """One step's schedule. Generic in the connector's metadata type only so a TP worker can
    decode it typed: `SchedulerOutput[PushMeta]` (engine/executor/worker_proc.py)."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens to compute this step
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)  # runner drops their state
    preempted_req_ids: set[str] = field(default_factory=set)  # runner drops their state
    kv_connector_metadata: M | None = None  # the scheduler half's, for the worker halves

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
