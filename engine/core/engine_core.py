"""EngineCore: the in-process heart of the engine — schedule, execute, update.

Single-threaded by contract: every method runs on the thread that owns the core (the
caller's thread in-process, the busy-loop thread in EngineCoreProc).
"""

from __future__ import annotations

import base64
import contextlib
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from engine.connector_registry import make_connector, make_scheduler_half
from engine.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    SamplingParams,
    SchedulerStats,
)
from engine.runner.model_runner import ModelRunner
from engine.sched.request import Request, RequestStatus
from engine.sched.scheduler import Scheduler
from engine.startup import freeze_startup_objects

if TYPE_CHECKING:
    from engine.executor.multiproc import MultiprocExecutor
    from engine.startup import StartupWatch

logger = logging.getLogger(__name__)


def _stage(watch: StartupWatch | None, name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if watch is None else watch.stage(name)


class EngineCore:
    """Owns the scheduler and the model runner. `step()` is the whole pipeline."""

    def __init__(self, config: EngineConfig, watch: StartupWatch | None = None) -> None:
        """With tensor_parallel_size > 1 the model runs in worker processes driven by a
        MultiprocExecutor (EngineCoreLoop hooks its death callback); otherwise the runner
        lives here, in this thread. `watch`: the process's start-up deadlines (stages
        tp_workers, model, kv_connector; engine/core/startup.py)."""
        self.config = config
        self.tp_executor: MultiprocExecutor | None = None
        if config.tensor_parallel_size > 1:
            from engine.executor.kv_outputs import TPConnectorView
            from engine.executor.multiproc import MultiprocExecutor

            self.runner = None
            with _stage(watch, "tp_workers"):
                self.tp_executor = MultiprocExecutor(config)
            self.executor: Any = self.tp_executor
            self.num_kv_blocks = min(i.num_kv_blocks for i in self.tp_executor.infos)
            self.max_model_len = self.tp_executor.infos[0].max_model_len
            sched_conn = worker_conn = None
            if self.tp_executor.kv_outputs is not None:  # P/D: worker halves in the ranks
                spec = self.tp_executor.collective_rpc("kv_cache_spec", unique_reply_rank=0)
                sched_conn = make_scheduler_half(config, spec)
                worker_conn = TPConnectorView(self.tp_executor, self.tp_executor.kv_outputs)
        else:
            with _stage(watch, "model"):
                self.runner = self.executor = ModelRunner(config)
            self.num_kv_blocks = self.runner.num_kv_blocks
            self.max_model_len = self.runner.max_model_len
            with _stage(watch, "kv_connector"):
                sched_conn, worker_conn = make_connector(config, self.runner.kv_cache_spec)
                if worker_conn is not None:
                    worker_conn.register_kv_caches(self.runner.kv_cache)
            self.runner.connector = worker_conn
        self.scheduler = Scheduler(
            block_size=config.block_size,
            num_blocks=self.num_kv_blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
            connector=sched_conn,
        )
        self.worker_connector = worker_conn
        freeze_startup_objects()
        logger.info("engine core ready: %d KV blocks of %d tokens", self.num_kv_blocks,
                    config.block_size)

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"request {request.request_id} is already running")
        self.scheduler.add_request(Request.from_engine_core_request(request))

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def step(self) -> EngineCoreOutputs:
        """Schedule → execute → update. Returns the outputs of this step (maybe none)."""
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        return EngineCoreOutputs(
            outputs=outputs, scheduler_stats=self.make_stats(), timestamp=time.time()
        )

    def make_stats(self) -> SchedulerStats:
        stats = self.scheduler.make_stats()
        for half in (self.scheduler.connector, self.worker_connector):
            if half is not None:
                stats.kv_connector.update(half.get_stats())
        return stats

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # Utility calls (also reachable over the utility RPC of EngineCoreProc).
    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def get_supported_tasks(self) -> list[str]:
        return ["generate"]

    def get_stats(self) -> dict[str, Any]:
        """Block and table accounting plus the current scheduler stats, fresh (metrics
        scrapes and leak checks use it)."""
        if self.tp_executor is not None and self.worker_connector is not None:
            self.worker_connector.refresh_stats()  # the ranks' counters, also when idle
        sched = self.make_stats()
        stats: dict[str, Any] = {
            "num_running_reqs": sched.num_running_reqs,
            "num_waiting_reqs": sched.num_waiting_reqs,
            "kv_cache_usage": sched.kv_cache_usage,
            "kv_connector": dict(sched.kv_connector),
            "num_kv_blocks": self.num_kv_blocks,
            "num_free_blocks": self.scheduler.kv_cache_manager.num_free_blocks,
            "num_unfinished_requests": self.scheduler.get_num_unfinished_requests(),
            "num_runner_requests": self.executor.num_requests,
        }
        if self.tp_executor is not None:
            stats["tp_worker_pids"] = list(self.tp_executor.worker_pids)
        for half in (self.scheduler.connector, self.worker_connector):
            if half is not None:
                stats.update(half.table_sizes())
        return stats

    def debug_prompt_kv(self, prompt_token_ids: list[int]) -> list[str]:
        """Raw bytes (base64) of the prefix-cached blocks holding this prompt's full blocks,
        in prompt order (stops at the first block not cached). Tests compare P's and D's."""
        if self.runner is None:
            raise ValueError("debug_prompt_kv reads one process's KV: tensor_parallel_size 1 only")
        probe = Request("debug-kv-probe", list(prompt_token_ids) + [0], SamplingParams(),
                        None)
        blocks, _ = self.scheduler.kv_cache_manager.get_computed_blocks(probe)
        return [base64.b64encode(self.runner.kv_cache[b.block_id].contiguous().numpy()
                                 .tobytes()).decode() for b in blocks]

    def shutdown(self) -> None:
        if self.worker_connector is not None:
            self.worker_connector.shutdown()
        if self.tp_executor is not None:
            self.tp_executor.shutdown()
