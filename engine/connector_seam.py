"""The typed seam between the engine and a KV connector's two halves.

A connector has a scheduler half (in the EngineCore, engine-core thread: `SchedulerConnector`)
and a worker half per tensor-parallel rank (beside that rank's model runner:
`WorkerConnector`). They talk through the engine only, once per step, in two messages that
may cross a process (the TP executor's rings, msgpack):
- scheduler half → worker halves: its `KVConnectorMetadata` subclass, riding on
  `SchedulerOutput.kv_connector_metadata`;
- worker half → scheduler half: a `KVConnectorOutput`, riding on
  `ModelRunnerOutput.kv_connector_output` (with TP, one per rank, combined by the executor).
Both are tagged msgspec structs, so the one decoder of each channel knows their type.

What a worker half bound at start-up (engine id, side-channel host and port: `KVBinding`)
goes back through the executor to the scheduler half (`bind_workers`) and to
`/kv_transfer/info`. Connector counters reach `/metrics` by one route: the engine reads
`get_stats()` of its scheduler half and, through the executor, of every worker half, when
stats are asked for (engine/core/engine_core.py).

This module sits below the scheduler, the runner and the executor (all three read it) and
names no connector.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from engine.protocol import Logprobs


class KVConnectorMetadata(msgspec.Struct, tag=True):
    """Base of a connector's per-step metadata (scheduler half → worker halves)."""

    def brings_work(self) -> bool:
        """Whether a worker half has anything to do with it (an empty one is not sent on)."""
        return False


class SeededToken(msgspec.Struct, array_like=True, frozen=True):
    """The first output token another engine sampled for a request whose whole prompt KV it
    computed (and, when the request asks for logprobs, that position's logprobs). A request
    seeded with it starts decoding from it: no forward pass over the last prompt position."""

    token_ids: list[int]
    logprobs: Logprobs | None = None


class KVConnectorOutput(msgspec.Struct, tag=True):
    """Worker half → scheduler half, once per step (with TP: all ranks combined)."""

    finished_sending: set[str] = set()  # P: blocks may be freed
    finished_recving: set[str] = set()  # D: KV landed
    failed_recving: dict[str, str] = {}  # D: id -> reason; wins over a receipt of the same id
    seeded: dict[str, SeededToken] = {}  # D: the first token that came with a receipt


class KVBinding(msgspec.Struct, array_like=True):
    """What one worker half bound at start-up: the engine id its agent runs under and the
    side channel it serves (host, and the port it bound: an ephemeral one is known only
    now)."""

    tp_rank: int
    engine_id: str
    host: str
    port: int


class RequestState(Protocol):
    """What a connector reads of a request's status (`engine.sched.request.RequestStatus`)."""

    @property
    def finished_normally(self) -> bool: ...


class ConnectorRequest(Protocol):
    """What a scheduler half may read of a request (`engine.sched.request.Request`)."""

    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None  # the wire form, as the client sent it
    kv_params: Any  # the connector's typed form of them, set once by `on_request_added`
    status: RequestState  # `.finished_normally`: the prompt's KV is complete
    output_token_ids: list[int]  # sampled so far
    last_logprobs: Logprobs | None  # of the last sampled position, when asked for

    @property
    def num_prompt_tokens(self) -> int: ...


class SchedulerConnector(Protocol):
    """The scheduler half, as `Scheduler` and `EngineCore` call it (engine-core thread)."""

    load_failure_policy: str  # "recompute" | "fail": a parked request whose KV failed

    def bind_workers(self, bindings: list[KVBinding]) -> None:
        """What the worker halves bound, once, after the executor started them and before
        the first request."""

    def on_request_added(self, request: ConnectorRequest) -> None: ...

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]: ...

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: list[int],
                                 num_external_tokens: int) -> None: ...

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata | None: ...

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]: ...

    def request_load_failed(self, request: ConnectorRequest, block_ids: list[int]) -> bool:
        """A parked request's KV will not arrive and it recomputes (`load_failure_policy`):
        True when a transfer may still write `block_ids` (the scheduler then holds them
        until the id is in `finished_sending` and gives the request fresh ones)."""

    def update_connector_output(self, output: KVConnectorOutput) -> None: ...

    def take_seeded_token(self, request: ConnectorRequest) -> SeededToken | None:
        """Called once when a parked request's KV has landed, before it is scheduled: the
        first output token that came with the KV (the scheduler appends it and decodes it
        next), or None to compute the last prompt position here."""

    def has_pending_work(self) -> bool: ...

    def table_sizes(self) -> dict[str, int]: ...

    def get_stats(self) -> dict[str, float]: ...


class WorkerConnector(Protocol):
    """One rank's worker half, as the model runner and the executor call it (the thread that
    runs the model: the engine-core thread, or a TP worker's main thread)."""

    meta_type: type[KVConnectorMetadata] | None  # its scheduler half's metadata struct

    def register_kv_caches(self, kv_cache: Any) -> None:
        """Start serving this KV memory (agent, side channel, transfer thread)."""

    def binding(self) -> KVBinding | None:
        """What `register_kv_caches` bound; None before."""

    def start_load_kv(self, metadata: KVConnectorMetadata | None) -> None:
        """This step's metadata (a TP rank decodes it typed by `meta_type`)."""

    def get_finished(self) -> KVConnectorOutput: ...

    def set_wakeup(self, wake: Callable[[], None]) -> bool:
        """Call `wake` (from any thread) whenever `get_finished` has something new to report;
        True when it will, so the engine may sleep instead of stepping to ask."""

    def table_sizes(self) -> dict[str, int]: ...

    def get_stats(self) -> dict[str, float]: ...

    def shutdown(self) -> None: ...
