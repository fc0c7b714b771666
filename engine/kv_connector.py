"""The KV-connector interface the scheduler and the model runner call, and a registry.

A connector has two halves that live in the same EngineCore process (TP = 1; with tensor
parallel the worker half of each rank lives in that rank's worker process, docs/design.md §8):
- the scheduler half runs on the engine-core thread inside `Scheduler.schedule()` /
  `update_from_output()`;
- the worker half runs on the same thread inside `ModelRunner.execute_model()`, and may
  own background threads of its own (the push writer).
The engine knows connectors only by name (`kv_transfer_config.kv_connector`), mapped below
to the `kvconnector` module that builds them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from engine.config import EngineConfig

if TYPE_CHECKING:
    from engine.sched.request import RequestStatus


@dataclass(frozen=True)
class KVCacheSpec:
    """What a connector needs to know about this engine's KV cache layout."""

    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    bytes_per_block: int  # one block across every layer, K and V (contiguous)
    model_name: str


class ConnectorRequest(Protocol):
    """What a scheduler half may read of a request (`engine.sched.request.Request`)."""

    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None  # the wire form, as the client sent it
    kv_params: Any  # the connector's typed form of them, set once by `on_request_added`
    status: RequestStatus  # `.finished_normally`: the prompt's KV is complete

    @property
    def num_prompt_tokens(self) -> int: ...


@dataclass
class KVConnectorOutput:
    """Worker half → scheduler half, once per step."""

    finished_sending: set[str] = field(default_factory=set)  # P: blocks may be freed
    finished_recving: set[str] = field(default_factory=set)  # D: KV landed
    failed_recving: dict[str, str] = field(default_factory=dict)  # D: id -> reason
    stats: dict[str, float] = field(default_factory=dict)


class KVConnectorScheduler:
    """Scheduler half. Every method is called on the engine-core thread."""

    load_failure_policy: str = "recompute"

    def on_request_added(self, request: ConnectorRequest) -> None:
        """A request entered the scheduler (before any block is allocated for it). A
        connector that reads kv_transfer_params decodes them here, once, into
        `request.kv_params`, and reads only that from then on."""
        return None

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Tokens the remote side will provide beyond the local hit, and whether async."""
        return 0, False

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return None

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Return (delay_free, kv_transfer_params for the final output)."""
        return False, None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        return None

    def has_pending_work(self) -> bool:
        return False

    def table_sizes(self) -> dict[str, int]:
        return {}

    def get_stats(self) -> dict[str, float]:
        """Cumulative counters, named like the Prometheus metrics without the prefix."""
        return {}


class KVConnectorWorker:
    """Worker half. Called on the engine-core thread; may own background threads."""

    def register_kv_caches(self, kv_cache: Any) -> None:
        return None

    def start_load_kv(self, metadata: Any) -> None:
        return None

    def get_finished(self) -> KVConnectorOutput:
        return KVConnectorOutput()

    def table_sizes(self) -> dict[str, int]:
        return {}

    def get_stats(self) -> dict[str, float]:
        return {}

    def shutdown(self) -> None:
        return None


KVParamsValidator = Callable[[dict[str, Any], Sequence[int]], None]

# name -> module. A connector module offers `make(config, spec)` -> (scheduler half, worker
# half), built together so they can share what only one of them learns (e.g. the bound
# side-channel port), and `request_params_validator(config)` -> KVParamsValidator; a
# connector that supports tensor parallel also `make_scheduler(config, spec)` and
# `make_worker(config, spec, tp_rank)`.
_CONNECTORS: dict[str, str] = {
    "NixlConnector": "kvconnector.pull.connector",
    "NixlPushConnector": "kvconnector.push.connector",
}


def _module(config: EngineConfig) -> Any | None:
    kv = config.kv_transfer_config
    if kv is None:
        return None
    if kv.kv_connector not in _CONNECTORS:
        raise ValueError(
            f"unknown kv_connector {kv.kv_connector!r}; known: {', '.join(sorted(_CONNECTORS))}"
        )
    return importlib.import_module(_CONNECTORS[kv.kv_connector])


def kv_params_validator(config: EngineConfig) -> KVParamsValidator | None:
    """The configured connector's check of a request's kv_transfer_params against its prompt
    token ids (ValueError naming the field), run in the frontend so a bad D leg is a 400, not
    an engine error. None without a known connector (the engine core refuses an unknown one)."""
    kv = config.kv_transfer_config
    if kv is None or kv.kv_connector not in _CONNECTORS:
        return None
    return _module(config).request_params_validator(config)


def make_connector(config: EngineConfig, spec: KVCacheSpec
                   ) -> tuple[KVConnectorScheduler | None, KVConnectorWorker | None]:
    """Build both halves of the configured connector, or (None, None) without one."""
    module = _module(config)
    return (None, None) if module is None else module.make(config, spec)


def make_scheduler_half(config: EngineConfig, spec: KVCacheSpec) -> KVConnectorScheduler | None:
    """The scheduler half alone (tensor parallel: EngineCore keeps it), or None."""
    module = _module(config)
    return None if module is None else module.make_scheduler(config, spec)


def make_worker_half(config: EngineConfig, spec: KVCacheSpec, tp_rank: int
                     ) -> KVConnectorWorker | None:
    """Rank `tp_rank`'s worker half, built in its worker process, or None."""
    module = _module(config)
    return None if module is None else module.make_worker(config, spec, tp_rank)
