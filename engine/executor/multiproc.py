"""MultiprocExecutor: EngineCore's handle on its N tensor-parallel worker processes.

Layout (seed 002; docs/design.md §8): one broadcast ring (this process writes, every worker
reads) carries each RPC — above all each step's SchedulerOutput; each worker answers on its
own response ring (it writes, we read). `execute_model` asks only rank 0 to answer
(unique_reply_rank): every rank computes the same tokens. Setup calls (`describe`) go to
every rank (collective RPC).

Failure: a monitor thread ("TPWorkerMonitor") waits on the worker process sentinels and
reads the workers' heartbeats (each worker stamps its response ring; engine/core/liveness.py).
When a worker exits outside shutdown, or gives no heartbeat for `heartbeat_timeout_s` (stopped,
frozen), it records why and calls `on_failure` (EngineCoreLoop.fail: the busy loop raises at
once, even when idle, and its owner reports the engine dead — ENGINE_CORE_DEAD with the
reason from a core process). The monitor also waits on the ranks' wake bells (P/D: one pipe
per rank; its connector writes a byte when it has news for `get_finished`) and wakes the engine
loop, so a loop whose requests all wait for remote KV sleeps, as at TP = 1. A call blocked
on a ring wakes on the same sentinels, checks the same heartbeats every `_CHECK_S`, and gives
up after `step_timeout_s` (a collective that never completes): it raises WorkerDied naming
the worker. Nothing waits without a bound.

Rendezvous: the ranks meet through a torch FileStore in a private (0700) directory of this
process, removed at shutdown — no TCP store, nothing listening on any interface; gloo's own
sockets are put on the loopback interface (worker_proc.py). On CPU the ranks' hot-path
all-reduce / all-gather runs over a shared segment this process creates (mode 0600, unlinked
once every rank has mapped it, and again at shutdown; shm_collectives.py).

Thread ownership: every method but `failure` / the monitor runs on the engine-core thread.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from engine.config import EngineConfig
from engine.connector_seam import KVBinding, KVConnectorOutput
from engine.executor import messages as m
from engine.executor.kv_outputs import KVOutputAggregator
from engine.executor.shm_broadcast import RingGone, ShmReader, ShmWriter
from engine.executor.shm_collectives import create_segment, remove_segment
from engine.executor.worker_proc import worker_main
from engine.models import load_arch
from engine.models.parallel import check_tp
from engine.runner_output import ModelRunnerOutput
from engine.sched.output import SchedulerOutput
from engine.startup import config_to_dict, heartbeat_interval, stage_deadline

logger = logging.getLogger(__name__)

_SHUTDOWN_JOIN_S = 5.0
_CHECK_S = 0.25  # how often a blocked call looks at the workers' heartbeats and its deadline


class WorkerDied(RuntimeError):
    """A tensor-parallel worker process exited while the engine needed it."""


@contextlib.contextmanager
def _may_have_children():
    # The EngineCore process is started daemonic (it dies with its frontend), and
    # multiprocessing refuses children of a daemon. Our workers are reaped by `shutdown` and
    # exit on their own when this process is gone (their parent watch), which is what that
    # rule protects, so lift it while starting them.
    config = multiprocessing.current_process()._config  # noqa: SLF001
    daemon = config.pop("daemon", None)
    try:
        yield
    finally:
        if daemon is not None:
            config["daemon"] = daemon


class MultiprocExecutor:
    def __init__(self, config: EngineConfig,
                 on_failure: Callable[[str], None] | None = None) -> None:
        self.tp_size = config.tensor_parallel_size
        check_tp(load_arch(config.model), self.tp_size)  # a clear error before any spawn
        self.on_failure = on_failure
        self.kv_outputs = (KVOutputAggregator(self.tp_size)
                           if config.kv_transfer_config is not None else None)
        self.failure: str | None = None
        self._closing = False
        self.heartbeat_timeout_s = config.heartbeat_timeout_s
        self.step_timeout_s = config.step_timeout_s
        self._startup_s = 0.9 * stage_deadline("tp_workers", config.startup_stage_timeout_s)
        ctx = multiprocessing.get_context("spawn")
        bells = [ctx.Pipe(duplex=False) for _ in range(self.tp_size)]
        self.broadcast = ShmWriter(self.tp_size, [send for _, send in bells])
        threads = max(1, torch.get_num_threads() // self.tp_size)
        self._store_dir = tempfile.mkdtemp(prefix="pdserve-tp-")  # 0700: ours alone
        store = os.path.join(self._store_dir, "rendezvous")
        self._comm_path = (None if config.device.startswith("cuda")
                           else create_segment(self._store_dir, self.tp_size))
        handle = m.encode(self.broadcast.handle)
        # P/D: each rank's connector rings its wake bell when it has news (set_wakeup).
        wake_bells = [ctx.Pipe(duplex=False) if self.kv_outputs is not None else (None, None)
                      for _ in range(self.tp_size)]
        self._wake_bells = [recv for recv, _ in wake_bells if recv is not None]
        self._wake: Callable[[], None] | None = None
        self.procs: list[multiprocessing.process.BaseProcess] = []
        ready_pipes, response_bells = [], []
        with _may_have_children():
            for rank in range(self.tp_size):
                ready_recv, ready_send = ctx.Pipe(duplex=False)
                resp_recv, resp_send = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=worker_main, name=f"TPWorker_{rank}", daemon=False,
                    args=(config_to_dict(config), rank, self.tp_size, store, threads, handle,
                          bells[rank][0], resp_send, ready_send, logging.getLogger().level,
                          self._comm_path, wake_bells[rank][1]))
                proc.start()
                ready_send.close()
                if wake_bells[rank][1] is not None:
                    wake_bells[rank][1].close()  # the worker's: EOF here once it is gone
                self.procs.append(proc)
                ready_pipes.append(ready_recv)
                response_bells.append(resp_recv)
        try:
            self.responses = [ShmReader(r.response_handle, 0, response_bells[r.rank])
                              for r in self._wait_ready(ready_pipes)]
            remove_segment(self._comm_path)  # every rank has it mapped: no name left behind
            self.infos: list[m.WorkerInfo] = self.collective_rpc("describe")
        except BaseException:
            self.shutdown()
            raise
        self.worker_pids = [i.pid for i in self.infos]
        self.num_kv_blocks = min(i.num_kv_blocks for i in self.infos)
        self.max_model_len = self.infos[0].max_model_len
        self.kv_cache_spec = self.collective_rpc("kv_cache_spec", unique_reply_rank=0)
        self._monitor = threading.Thread(target=self._watch_workers, name="TPWorkerMonitor",
                                         daemon=True)
        self._monitor.start()
        logger.info("tensor parallel: %d workers ready (pids %s, %d torch thread(s) each, "
                    "%s collectives)", self.tp_size, self.worker_pids, threads,
                    "/".join(sorted({i.collectives for i in self.infos})))

    def _wait_ready(self, pipes: list) -> list[m.WorkerReady]:
        """Every worker's WorkerReady, in rank order; raises on a failure, death or timeout."""
        got: dict[int, m.WorkerReady] = {}
        deadline = time.monotonic() + self._startup_s
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs)}
        pending = {pipe: rank for rank, pipe in enumerate(pipes)}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"tensor-parallel workers {sorted(pending.values())} not "
                                   f"ready within {self._startup_s:.0f}s (start-up stage "
                                   "'tp_workers')")
            for obj in wait([*pending, *sentinels], timeout=left):
                if obj in pending:
                    try:
                        msg = m.decode_startup(obj.recv_bytes())
                    except EOFError:
                        continue  # closed without a message: its sentinel says why
                    if isinstance(msg, m.WorkerFailed):
                        raise RuntimeError(f"tensor-parallel worker {msg.rank} failed to "
                                           f"start: {msg.error}")
                    got[msg.rank] = msg
                    del pending[obj]
                elif sentinels[obj] in pending.values():
                    rank = sentinels[obj]
                    raise RuntimeError(f"tensor-parallel worker {rank} exited during startup "
                                       f"(exit code {self.procs[rank].exitcode})")
        return [got[r] for r in range(self.tp_size)]

    # -- RPC (engine-core thread) --------------------------------------------------------
    def collective_rpc(self, method: str, arg: Any = None,
                       unique_reply_rank: int | None = None) -> Any:
        """Run `method(arg)` on every worker. Returns the list of results in rank order, or
        only rank `unique_reply_rank`'s result (the others do not answer)."""
        if self.failure is not None:
            raise WorkerDied(self.failure)
        reply_rank = m.ALL_RANKS if unique_reply_rank is None else unique_reply_rank
        sentinels = [p.sentinel for p in self.procs]
        started = time.monotonic()
        try:
            self.broadcast.put(m.encode_call(method, arg, reply_rank), sentinels,
                               check=lambda: self._check_progress(method, 0, started))
            ranks = range(self.tp_size) if unique_reply_rank is None else [unique_reply_rank]
            results = [self._reply(method, r, sentinels, started) for r in ranks]
        except RingGone as e:
            self.failure = self.failure or self._describe_death() or str(e)
            raise WorkerDied(self.failure) from None
        except WorkerDied as e:
            self.failure = self.failure or str(e)
            raise
        return results if unique_reply_rank is None else results[0]

    def _reply(self, method: str, rank: int, sentinels: list, started: float) -> Any:
        while True:
            try:
                data = self.responses[rank].get(sentinels, timeout=_CHECK_S)
                break
            except TimeoutError:
                pass
            self._check_progress(method, rank, started)
        result = m.decode_reply(method, data)
        if isinstance(result, m.RpcReply):
            raise RuntimeError(f"tensor-parallel worker {rank}: {method} failed: "
                               f"{result.error}")
        return result

    def _check_progress(self, method: str, rank: int, started: float) -> None:
        """Raises WorkerDied when a worker is silent or the call has run past its deadline."""
        if (silent := self._silent_worker()) is not None:
            raise WorkerDied(silent)
        waited = time.monotonic() - started
        if waited > self.step_timeout_s:
            raise WorkerDied(f"tensor-parallel worker {rank} (pid {self.procs[rank].pid}) has "
                             f"not answered {method} for {waited:.0f}s (step_timeout_s "
                             f"{self.step_timeout_s:g}): the step is stuck")

    def _silent_worker(self) -> str | None:
        """Why the first worker without a heartbeat for heartbeat_timeout_s is declared hung."""
        for rank, reader in enumerate(getattr(self, "responses", ())):
            silent = reader.writer_silence_s()
            if silent > self.heartbeat_timeout_s:
                return (f"tensor-parallel worker {rank} (pid {self.procs[rank].pid}) is not "
                        f"responding: no heartbeat for {silent:.1f}s (heartbeat_timeout_s "
                        f"{self.heartbeat_timeout_s:g}; the process is stopped or frozen)")
        return None

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.kv_outputs is None:
            return self.collective_rpc("execute_model", scheduler_output, unique_reply_rank=0)
        # P/D: every rank reports what its connector worker half finished; tokens from rank 0.
        outs = self.collective_rpc("execute_model", scheduler_output)
        outs[0].kv_connector_output = self.kv_outputs.combine(
            [o.kv_connector_output or KVConnectorOutput() for o in outs])
        return outs[0]

    @property
    def num_requests(self) -> int:
        return self.collective_rpc("num_requests", unique_reply_rank=0)

    # -- the connector's worker halves (one per rank) -------------------------------------
    def kv_bindings(self) -> list[KVBinding]:
        return [i.kv_binding for i in self.infos if i.kv_binding is not None]

    def connector_stats(self) -> dict[str, float]:
        """Every rank's counters now, summed (also when idle: a rank's transfer thread counts
        what peers send without any step)."""
        if self.kv_outputs is None:
            return {}
        total: Counter[str] = Counter()
        for per_rank in self.collective_rpc("kv_stats"):
            total.update(per_rank)
        return dict(total)

    def set_wakeup(self, wake: Callable[[], None]) -> bool:
        """The worker halves ring their wake bells (one pipe per rank, a byte per news); the
        monitor thread, which waits on them with the sentinels, calls `wake`."""
        if not self._wake_bells or not all(i.wakes for i in self.infos):
            return False
        self._wake = wake
        return True

    def connector_tables(self) -> dict[str, int]:
        if self.kv_outputs is None:
            return {}
        total = Counter(self.kv_outputs.table_sizes())
        for sizes in self.collective_rpc("kv_table_sizes"):
            total.update(sizes)
        return dict(total)

    def read_kv_blocks(self, block_ids: list[int]) -> list[bytes]:
        raise ValueError("debug_prompt_kv reads one process's KV: tensor_parallel_size 1 only")

    # -- failure detection (monitor thread) -----------------------------------------------
    def _describe_death(self) -> str | None:
        for rank, p in enumerate(self.procs):
            if p.exitcode is not None:
                return (f"tensor-parallel worker {rank} (pid {p.pid}) died "
                        f"(exit code {p.exitcode})")
        return None

    def _watch_workers(self) -> None:
        sentinels = [p.sentinel for p in self.procs]
        bells = list(self._wake_bells)
        interval = heartbeat_interval(self.heartbeat_timeout_s)
        silent = None
        next_check = time.monotonic() + interval
        while not self._closing:
            fired = wait([*sentinels, *bells], timeout=max(0.0, next_check - time.monotonic()))
            if any(obj in sentinels for obj in fired):
                break
            for bell in fired:
                self._ring(bell, bells)
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + interval
                if (silent := self._silent_worker()) is not None:
                    break
        if self._closing:
            return
        self.failure = (self.failure or silent or self._describe_death()
                        or "a tensor-parallel worker died")
        logger.error("%s; failing the engine", self.failure)
        if self.on_failure is not None:
            self.on_failure(self.failure)

    def _ring(self, bell: Connection, bells: list[Connection]) -> None:
        """A rank's connector has news: drain its bell, wake the engine loop (once)."""
        try:
            got = os.read(bell.fileno(), 4096)
        except BlockingIOError:
            return
        if not got:
            bells.remove(bell)  # the rank closed it (exiting): its sentinel says why
            return
        if self._wake is not None:
            self._wake()

    # -- shutdown (engine-core thread) ----------------------------------------------------
    def shutdown(self) -> None:
        """Ask every worker to stop, then make sure: terminate, kill. Idempotent."""
        if self._closing:
            return
        self._closing = True
        if self.failure is None and all(p.is_alive() for p in self.procs):
            with contextlib.suppress(Exception):
                self.broadcast.put(m.encode_call("shutdown", None, m.ALL_RANKS),
                                   [p.sentinel for p in self.procs])
        # After a death the survivors may sit in an all-reduce that never completes: no wait.
        wait_s = 0.0 if self.failure is not None else _SHUTDOWN_JOIN_S
        deadline = time.monotonic() + wait_s
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=_SHUTDOWN_JOIN_S)
        for r in getattr(self, "responses", []):
            r.close(unlink=True)  # a killed worker cannot; after a clean exit it is a no-op
        self.broadcast.close()
        remove_segment(self._comm_path)
        for bell in self._wake_bells:
            bell.close()
        shutil.rmtree(self._store_dir, ignore_errors=True)

