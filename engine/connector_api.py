"""The KV-connector interface the scheduler and the model runner call, and a registry.

A connector has two halves that live in the same EngineCore process (TP = 1; with tensor
parallel the worker half of each rank lives in that rank's worker process, docs/design.md §8):
- the scheduler half runs on the engine-core thread inside `Scheduler.schedule()` /
  `update_from_output()`;
- the worker half runs on the same thread inside `ModelRunner.execute_model()`, and may
  own background threads of its own (the push writer).
The engine knows connectors only by name (`kv_transfer_config.kv_connector`): a connector
package brings a `ConnectorSpec` (below) and registers it under that name
(engine/connector_registry.py); everything the engine must know of a connector — its config
rules, its kv_transfer_params, its side-channel port layout, its metrics, how to build its
halves — it asks the spec.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engine.connector_seam import (
    ConnectorRequest,
    KVBinding,
    KVConnectorMetadata,
    KVConnectorOutput,
    SeededToken,
)
from engine.kv_transfer_config import KVTransferConfig


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
    vocab_size: int = 0  # token ids a seeded first token may take (0: unknown, none)


class KVConnectorScheduler:
    """Scheduler half. Every method is called on the engine-core thread."""

    load_failure_policy: str = "recompute"

    def bind_workers(self, bindings: list[KVBinding]) -> None:
        """What the worker halves bound (engine id, side channel), rank order; called once,
        after the executor started them, before any request arrives."""
        return None

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

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata | None:
        return None

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Return (delay_free, kv_transfer_params for the final output)."""
        return False, None

    def request_load_failed(self, request: ConnectorRequest, block_ids: list[int]) -> bool:
        """The request recomputes after a failed receipt: True when a transfer may still
        write its blocks (held until `finished_sending`; the request gets fresh ones)."""
        return False

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        return None

    def take_seeded_token(self, request: ConnectorRequest) -> SeededToken | None:
        """A parked request's KV landed: the first output token that came with it, or None
        (the scheduler then computes the last prompt position itself)."""
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

    meta_type: type[KVConnectorMetadata] | None = None  # the scheduler half's metadata

    def register_kv_caches(self, kv_cache: Any) -> None:
        return None

    def binding(self) -> KVBinding | None:
        """What `register_kv_caches` bound (engine id, side channel); None before."""
        return None

    def start_load_kv(self, metadata: Any) -> None:
        return None

    def get_finished(self) -> KVConnectorOutput:
        return KVConnectorOutput()

    def set_wakeup(self, wake: Callable[[], None]) -> bool:
        """Call `wake` (any thread) when `get_finished` has news; False: the engine polls."""
        return False

    def table_sizes(self) -> dict[str, int]:
        return {}

    def get_stats(self) -> dict[str, float]:
        return {}

    def shutdown(self) -> None:
        return None


KVParamsValidator = Callable[[dict[str, Any], Sequence[int]], None]


class ConnectorConfig(Protocol):
    """What a connector spec reads of the engine config: `engine.config.EngineConfig`, which
    asks the spec to validate it (a Protocol, so this module stays below engine.config)."""

    @property
    def model(self) -> str: ...

    @property
    def tensor_parallel_size(self) -> int: ...

    @property
    def data_parallel_size(self) -> int: ...

    @property
    def data_parallel_external_lb(self) -> bool: ...

    @property
    def kv_transfer_config(self) -> KVTransferConfig | None: ...


class ConnectorSpec:
    """Everything the engine knows of one connector, registered under `name`
    (engine/connector_registry.py). A connector package subclasses it; the engine calls it
    from any thread. Apart from the builders, every method is pure: no I/O, no threads."""

    name: str = ""
    # The transfer counters the halves report in their stats (cumulative values), name ->
    # help; the server exports each as `pdserve:<name>` (docs/design.md §3, Metrics).
    counters: Mapping[str, str] = {}
    # Summaries the halves report as `<name>_sum` / `<name>_count`: name -> (help, the counter
    # that counts its observations when the stats carry no `<name>_count`).
    summaries: Mapping[str, tuple[str, str]] = {}
    # Data parallel: an unpinned request whose params `is_prefill_leg` goes to rank 0, the
    # rank the top level of /kv_transfer/info names (docs/design.md §9).
    pins_prefill_leg: bool = False

    def validate(self, config: ConnectorConfig) -> None:
        """Raise ValueError naming what this connector cannot run with (called by
        `EngineConfig.__post_init__`)."""
        return None

    def side_channel_port(self, base: int, dp_rank: int, tp_rank: int, tp_size: int) -> int:
        """The side-channel port of data-parallel rank `dp_rank`'s tensor-parallel rank
        `tp_rank`, from the configured `base` (0: ephemeral, chosen by each rank)."""
        raise NotImplementedError

    def params_validator(self, config: ConnectorConfig) -> KVParamsValidator | None:
        """The frontend's admission check of a request's kv_transfer_params against its prompt
        token ids (ValueError naming the field: a 400), or None."""
        return None

    def is_prefill_leg(self, kv_transfer_params: Any) -> bool:
        """True when these (raw) params make the request a prefill leg."""
        return False

    def prefilled_elsewhere(self, kv_transfer_params: Any) -> bool:
        """True when these (raw) params make the request a decode leg whose prompt KV comes
        from another engine (no prefill forward here: no prompt logprobs)."""
        return False

    def prompt_params(self, kv_transfer_params: dict[str, Any], index: int, count: int
                      ) -> dict[str, Any] | None:
        """The params of prompt `index` of a list of `count` prompts sent with these."""
        return kv_transfer_params

    def sample_params(self, kv_transfer_params: dict[str, Any], index: int
                      ) -> dict[str, Any] | None:
        """The params of child `index` of a request with n > 1 samples."""
        return kv_transfer_params

    def make_scheduler(self, config: ConnectorConfig, cache: KVCacheSpec
                       ) -> KVConnectorScheduler:
        """The scheduler half (the EngineCore's, at every TP size); it learns what the
        worker halves bound through `bind_workers`."""
        raise NotImplementedError

    def make_worker(self, config: ConnectorConfig, cache: KVCacheSpec, tp_rank: int
                    ) -> KVConnectorWorker:
        """Rank `tp_rank`'s worker half, built in its worker process."""
        raise NotImplementedError
