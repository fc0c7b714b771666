"""What EngineCore drives: an `Executor`, the same at every tensor-parallel size.

`UniprocExecutor` (TP = 1) runs the model runner in the caller's thread; `MultiprocExecutor`
(TP > 1) drives one worker process per rank (docs/design.md §8). Either builds the connector's
worker half beside each runner (one assembly path: `engine.connector_registry.
make_worker_half`), so the core builds only the scheduler half and hands it what the worker
halves bound (`kv_bindings`). Every method runs on the engine-core thread; `on_failure` may
be called from the executor's own monitor thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from engine.executor.multiproc import MultiprocExecutor
from engine.executor.uniproc import UniprocExecutor
from engine.startup import stage

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.connector_api import KVCacheSpec
    from engine.connector_seam import KVBinding
    from engine.runner_output import ModelRunnerOutput
    from engine.sched.output import SchedulerOutput
    from engine.startup import StartupWatch


class Executor(Protocol):
    num_kv_blocks: int  # the smallest rank's, with TP
    max_model_len: int
    kv_cache_spec: KVCacheSpec  # rank 0's layout (what the scheduler half plans with)
    worker_pids: list[int]  # the TP worker processes; [] in-process
    failure: str | None  # why the executor cannot run any more (a worker died), or None
    on_failure: Callable[[str], None] | None  # called once with `failure`, any thread

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    @property
    def num_requests(self) -> int: ...

    def set_wakeup(self, wake: Callable[[], None]) -> bool:
        """Have the connector's worker half call `wake` (any thread) when it has news for
        `get_finished`; False when it cannot (none, or in other processes)."""

    def kv_bindings(self) -> list[KVBinding]:
        """What each rank's connector worker half bound, rank order ([] without one)."""

    def connector_stats(self) -> dict[str, float]:
        """The worker halves' cumulative counters now, summed over ranks."""

    def connector_tables(self) -> dict[str, int]:
        """The worker halves' table sizes (leak checks), summed over ranks."""

    def read_kv_blocks(self, block_ids: list[int]) -> list[bytes]:
        """Raw bytes of these KV blocks (debug; one process's KV: TP = 1 only)."""

    def shutdown(self) -> None: ...


def make_executor(config: EngineConfig, watch: StartupWatch | None = None) -> Executor:
    """The executor for `config.tensor_parallel_size`, started (model loaded, worker halves
    bound). `watch`: this process's start-up deadlines (engine/startup.py)."""
    if config.tensor_parallel_size > 1:
        with stage(watch, "tp_workers"):
            return MultiprocExecutor(config)
    return UniprocExecutor(config, watch)
