"""UniprocExecutor: tensor_parallel_size 1 — the model runner and the connector's worker half
live in this process and run on the engine-core thread (docs/design.md §8 is the TP case).

Start-up stages (engine/startup.py): `model` (weights and KV memory), `kv_connector` (the
worker half's agent, memory registration and side channel).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.connector_registry import make_worker_half
from engine.connector_seam import KVBinding, WorkerConnector
from engine.runner.model_runner import ModelRunner
from engine.startup import stage

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.runner_output import ModelRunnerOutput
    from engine.sched.output import SchedulerOutput
    from engine.startup import StartupWatch


class UniprocExecutor:
    def __init__(self, config: EngineConfig, watch: StartupWatch | None = None) -> None:
        with stage(watch, "model"):
            self.runner = ModelRunner(config)
        self.num_kv_blocks = self.runner.num_kv_blocks
        self.max_model_len = self.runner.max_model_len
        self.kv_cache_spec = self.runner.kv_cache_spec
        self.worker_pids: list[int] = []
        self.failure: str | None = None  # an in-process step that fails raises instead
        self.on_failure: Callable[[str], None] | None = None
        self.connector: WorkerConnector | None = None
        with stage(watch, "kv_connector"):
            self.connector = make_worker_half(config, self.kv_cache_spec, 0)
            if self.connector is not None:
                self.connector.register_kv_caches(self.runner.kv_cache)
        self.runner.connector = self.connector

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    @property
    def num_requests(self) -> int:
        return self.runner.num_requests

    def set_wakeup(self, wake: Callable[[], None]) -> bool:
        return self.connector is not None and self.connector.set_wakeup(wake)

    def kv_bindings(self) -> list[KVBinding]:
        bound = None if self.connector is None else self.connector.binding()
        return [] if bound is None else [bound]

    def connector_stats(self) -> dict[str, float]:
        return {} if self.connector is None else self.connector.get_stats()

    def connector_tables(self) -> dict[str, int]:
        return {} if self.connector is None else self.connector.table_sizes()

    def read_kv_blocks(self, block_ids: list[int]) -> list[bytes]:
        cache = self.runner.kv_cache
        return [cache[b].contiguous().numpy().tobytes() for b in block_ids]

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()
