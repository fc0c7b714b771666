"""EngineCore: the in-process heart of the engine — schedule, execute, update.

Single-threaded by contract: every method runs on the thread that owns the core (the
caller's thread in-process, the busy-loop thread in EngineCoreProc).
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import msgspec

from engine.config import EngineConfig
from engine.connector_registry import make_scheduler_half
from engine.executor.protocol import Executor, make_executor
from engine.kv_events import KVEventRecorder, ZmqEventPublisher, prefix_cache_digest
from engine.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    SamplingParams,
    SchedulerStats,
)
from engine.sched.request import Request, RequestStatus
from engine.sched.scheduler import Scheduler
from engine.startup import freeze_startup_objects
from engine.structured.grammars import compile_grammar
from engine.threads import DecodePace

if TYPE_CHECKING:
    from engine.startup import StartupWatch

logger = logging.getLogger(__name__)


class EngineCore:
    """Owns the scheduler and the executor. `step()` is the whole pipeline."""

    def __init__(self, config: EngineConfig, watch: StartupWatch | None = None) -> None:
        """The executor (in-process at TP = 1, worker processes at TP > 1: one path either
        way) loads the model and builds the connector's worker half beside each runner; the
        core builds the scheduler half and hands it what the worker halves bound. `watch`:
        the process's start-up deadlines (stages tp_workers, model, kv_connector;
        engine/startup.py). EngineCoreLoop hooks `executor.on_failure`."""
        self.config = config
        self.executor: Executor = make_executor(config, watch)
        self.num_kv_blocks = self.executor.num_kv_blocks
        self.max_model_len = self.executor.max_model_len
        connector = make_scheduler_half(config, self.executor.kv_cache_spec)
        if connector is not None:
            connector.bind_workers(self.executor.kv_bindings())
        self.scheduler = Scheduler(
            block_size=config.block_size,
            num_blocks=self.num_kv_blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
            connector=connector,
        )
        self.pace = DecodePace()  # decode steps held for KV about to land, on shared cores
        self.kv_events: tuple[KVEventRecorder, ZmqEventPublisher] | None = None
        if config.kv_events_config is not None and config.kv_events_config.enabled:
            recorder = KVEventRecorder(config.block_size)
            self.scheduler.kv_cache_manager.block_pool.events = recorder
            self.kv_events = (recorder, ZmqEventPublisher(config.kv_events_config,
                                                          config.data_parallel_rank or 0))
        freeze_startup_objects()
        logger.info("engine core ready: %d KV blocks of %d tokens", self.num_kv_blocks,
                    config.block_size)

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"request {request.request_id} is already running")
        grammar = request.sampling_params.structured
        if grammar is not None:  # refused here, not in the runner mid-step (then cached there)
            compile_grammar(self.config.model, self.executor.kv_cache_spec.vocab_size, grammar)
        self.scheduler.add_request(Request.from_engine_core_request(request))

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def step(self) -> EngineCoreOutputs:
        """Schedule → execute → update. Returns the outputs of this step (maybe none)."""
        self.pace.wait(self.scheduler.decode_awaits_kv())
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self._publish_kv_events()
        return EngineCoreOutputs(
            outputs=outputs, scheduler_stats=self.make_stats(), timestamp=time.time()
        )

    def make_stats(self) -> SchedulerStats:
        """The scheduler's counts, each step. Connector counters are not here: they are read
        when stats are asked for (`get_stats`), the one route to /metrics."""
        return self.scheduler.make_stats()

    def connector_stats(self) -> dict[str, float]:
        """Cumulative connector counters now: the scheduler half's and, through the executor,
        every worker half's (summed over TP ranks)."""
        connector = self.scheduler.connector
        stats = {} if connector is None else dict(connector.get_stats())
        stats.update(self.executor.connector_stats())
        return stats

    def kv_bindings(self) -> list[dict[str, Any]]:
        """What the connector's worker halves bound (engine id, side-channel host and port),
        one per TP rank in rank order; [] without a connector (`/kv_transfer/info`)."""
        return [msgspec.structs.asdict(b) for b in self.executor.kv_bindings()]

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # Utility calls (also reachable over the utility RPC of EngineCoreProc).
    def reset_prefix_cache(self) -> bool:
        ok = self.scheduler.reset_prefix_cache()
        self._publish_kv_events()
        return ok

    def _publish_kv_events(self) -> None:
        """One batch per step that changed the prefix cache (--kv-events-config)."""
        if self.kv_events is not None and self.kv_events[0].events:
            recorder, publisher = self.kv_events
            publisher.publish(recorder.take())

    def get_supported_tasks(self) -> list[str]:
        return ["generate"]

    def get_stats(self) -> dict[str, Any]:
        """Block and table accounting plus the current scheduler stats, fresh (metrics
        scrapes and leak checks use it)."""
        sched = self.make_stats()
        stats: dict[str, Any] = {
            "num_running_reqs": sched.num_running_reqs,
            "num_waiting_reqs": sched.num_waiting_reqs,
            "kv_cache_usage": sched.kv_cache_usage,
            # the scrape replaces the step's snapshot with this answer: the cumulative
            # counters must be here too, or vllm:prefix_cache_* / num_preemptions read 0
            "prefix_cache_queries": sched.prefix_cache_queries,
            "prefix_cache_hits": sched.prefix_cache_hits,
            "num_preemptions": sched.num_preemptions,
            "kv_connector": self.connector_stats(),
            "num_kv_blocks": self.num_kv_blocks,
            "num_free_blocks": self.scheduler.kv_cache_manager.num_free_blocks,
            "num_unfinished_requests": self.scheduler.get_num_unfinished_requests(),
            "num_runner_requests": self.executor.num_requests,
            **prefix_cache_digest(self.scheduler.kv_cache_manager.block_pool.cached_hashes()),
        }
        if self.executor.worker_pids:
            stats["tp_worker_pids"] = list(self.executor.worker_pids)
        if self.scheduler.connector is not None:
            stats.update(self.scheduler.connector.table_sizes())
        stats.update(self.executor.connector_tables())
        return stats

    def debug_prompt_kv(self, prompt_token_ids: list[int]) -> list[str]:
        """Raw bytes (base64) of the prefix-cached blocks holding this prompt's full blocks,
        in prompt order (stops at the first block not cached). Tests compare P's and D's."""
        probe = Request("debug-kv-probe", list(prompt_token_ids) + [0], SamplingParams(),
                        None)
        blocks, _ = self.scheduler.kv_cache_manager.get_computed_blocks(probe)
        raw = self.executor.read_kv_blocks([b.block_id for b in blocks])
        return [base64.b64encode(r).decode() for r in raw]

    def shutdown(self) -> None:
        if self.kv_events is not None:
            self.kv_events[1].shutdown()
        self.executor.shutdown()
