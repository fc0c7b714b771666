"""One tensor-parallel worker process: rank `rank` of `tp_size` (docs/design.md §8).

Startup (seed order), each step a start-up stage with a deadline (engine/startup.py):
join the torch.distributed process group (`rendezvous`: gloo on CPU, nccl on CUDA, through a
FileStore in the executor's private directory; gloo's and nccl's sockets on the loopback
interface — nothing of the group is reachable from another host), build this rank's model
shard and KV memory (`model`; on CPU the rank also maps the executor's shared segment, whose
all-reduce / all-gather the TP layers use instead of gloo's: shm_collectives.py) and
connector half (`kv_connector`), create the response ring,
then report `WorkerReady` (with the ring's handle) over the ready pipe (`ready`) — or
`WorkerFailed` with the error. Then the busy loop: read one RPC from the broadcast ring, run
it, answer on the response ring when this rank is the one asked (or all are).

Threads: the main thread runs the loop and owns the runner; "WorkerParentWatch_<rank>" exits
the process when the EngineCore process is gone (a rank can be blocked in an all-reduce
whose peer died, so the loop alone cannot notice); "WorkerHeartbeat_<rank>" stamps the
response ring's heartbeat, so the executor can tell a stopped worker from a slow step.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from engine import stackdump
from engine.config import EngineConfig
from engine.connector_api import KVCacheSpec
from engine.connector_registry import make_worker_half
from engine.executor import messages as m
from engine.executor.shm_broadcast import RingGone, RingHandle, ShmReader, ShmWriter
from engine.executor.shm_collectives import GLOO, make_collectives
from engine.runner_output import ModelRunnerOutput
from engine.sched.output import SchedulerOutput
from engine.startup import StartupWatch, freeze_startup_objects, heartbeat_interval

logger = logging.getLogger(__name__)

EXIT_PARENT_DIED = 3
_RESPONSE_SLOTS = 4


class Worker:
    """The RPC surface of one rank: every method named in messages.RPC_TYPES."""

    def __init__(self, config: EngineConfig, rank: int, tp_size: int,
                 watch: StartupWatch, comm_path: str | None = None,
                 wake_bell: Connection | None = None) -> None:
        from engine.runner.model_runner import ModelRunner

        self.rank = rank
        with watch.stage("model"):  # (may build the kernels, the collectives' among them)
            comm, self.comm_kind = ((GLOO, "gloo") if config.device.startswith("cuda") else
                                    make_collectives(comm_path, rank, tp_size,
                                                     config.step_timeout_s))
            self.runner = ModelRunner(config, tp_rank=rank, tp_size=tp_size, comm=comm)
        # P/D: this rank's connector worker half (its own NIXL agent, side channel and
        # transfer thread) over this rank's KV memory; the scheduler half is in EngineCore.
        with watch.stage("kv_connector"):
            self.connector = make_worker_half(config, self.runner.kv_cache_spec, rank)
            if self.connector is not None:
                self.connector.register_kv_caches(self.runner.kv_cache)
        self.runner.connector = self.connector
        # The connector's news (KV landed, a transfer failed) rings the executor's wake bell,
        # so a parked engine loop sleeps until then instead of stepping to ask.
        self.wakes = (self.connector is not None and wake_bell is not None
                      and self.connector.set_wakeup(_ringer(wake_bell)))
        meta = None if self.connector is None else self.connector.meta_type
        self._so_decoder = msgspec.msgpack.Decoder(
            SchedulerOutput if meta is None else SchedulerOutput[meta])

    def execute_model(self, raw: msgspec.Raw) -> ModelRunnerOutput:
        return self.runner.execute_model(self._so_decoder.decode(raw))

    def kv_cache_spec(self, _: None) -> KVCacheSpec:
        return self.runner.kv_cache_spec

    def kv_table_sizes(self, _: None) -> dict[str, int]:
        return {} if self.connector is None else self.connector.table_sizes()

    def kv_stats(self, _: None) -> dict[str, float]:
        return {} if self.connector is None else self.connector.get_stats()

    def describe(self, _: None) -> m.WorkerInfo:
        r = self.runner
        return m.WorkerInfo(rank=self.rank, pid=os.getpid(), num_kv_blocks=r.num_kv_blocks,
                            max_model_len=r.max_model_len, num_heads=r.model.num_heads,
                            num_kv_heads=r.model.num_kv_heads,
                            torch_threads=torch.get_num_threads(),
                            kv_binding=None if self.connector is None
                            else self.connector.binding(), collectives=self.comm_kind,
                            wakes=self.wakes)

    def num_requests(self, _: None) -> int:
        return self.runner.num_requests

    def shutdown(self, _: None) -> None:
        if self.connector is not None:
            self.connector.shutdown()


def _ringer(bell: Connection) -> Callable[[], None]:
    """A wake-up any thread may call: one byte into the executor's pipe, never blocking (a
    full pipe already holds a wake-up the executor has not read yet)."""
    fd = bell.fileno()
    os.set_blocking(fd, False)

    def ring() -> None:
        with contextlib.suppress(OSError):  # full (a wake-up is pending) or the parent is gone
            os.write(fd, b"!")

    return ring


def _loopback_only(backend: str) -> None:
    """gloo and nccl open sockets of their own between the ranks (all on this host): on the
    loopback interface, never on one another host can reach."""
    import psutil

    name = next((nic for nic, addrs in psutil.net_if_addrs().items()
                 if any(a.address == "127.0.0.1" for a in addrs)), "lo")
    os.environ["GLOO_SOCKET_IFNAME" if backend == "gloo" else "NCCL_SOCKET_IFNAME"] = name


def _beat(response: ShmWriter, interval: float, stop: threading.Event) -> None:
    while not stop.wait(interval):
        try:
            response.beat()
        except (ValueError, TypeError, IndexError):
            return  # the ring is closed: the worker is exiting


def _watch_parent() -> None:
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    wait([parent.sentinel])
    os._exit(EXIT_PARENT_DIED)


def worker_main(config: dict[str, Any], rank: int, tp_size: int, store_path: str,
                threads: int, broadcast: bytes, broadcast_bell: Connection,
                response_bell: Connection, ready: Connection,
                log_level: int = logging.INFO, comm_path: str | None = None,
                wake_bell: Connection | None = None) -> None:
    """Entry point of the spawned worker. Never returns."""
    logging.basicConfig(level=log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [TPWorker_{rank} pid=%(process)d] "
                               "%(name)s: %(message)s")
    threading.current_thread().name = f"TPWorker_{rank}"
    stackdump.install()
    # Ctrl-C reaches the whole process group: the EngineCore drains, and its workers must
    # keep serving until it says `shutdown` (or is gone), so they ignore SIGINT / SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, name=f"WorkerParentWatch_{rank}",
                     daemon=True).start()
    torch.set_num_threads(threads)
    torch.manual_seed(config["seed"])  # every rank samples the same tokens
    response: ShmWriter | None = None
    beats = threading.Event()
    cfg = EngineConfig(**config)
    watch = StartupWatch(f"tensor-parallel worker {rank}", cfg.startup_stage_timeout_s)
    try:
        backend = "nccl" if cfg.device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(rank)
        with watch.stage("rendezvous"):
            _loopback_only(backend)
            dist.init_process_group(backend, store=dist.FileStore(store_path, tp_size),
                                    rank=rank, world_size=tp_size)
        worker = Worker(cfg, rank, tp_size, watch, comm_path, wake_bell)
        reader = ShmReader(msgspec.msgpack.decode(broadcast, type=RingHandle), rank,
                           broadcast_bell)
        response = ShmWriter(1, [response_bell], num_slots=_RESPONSE_SLOTS)
        threading.Thread(target=_beat, args=(response, heartbeat_interval(
            cfg.heartbeat_timeout_s), beats), name=f"WorkerHeartbeat_{rank}",
            daemon=True).start()
        freeze_startup_objects()
    except Exception as e:
        logger.exception("worker %d failed to start", rank)
        ready.send_bytes(m.encode(m.WorkerFailed(rank, f"{type(e).__name__}: {e}")))
        os._exit(1)
    with watch.stage("ready"):
        ready.send_bytes(m.encode(m.WorkerReady(rank, os.getpid(), response.handle)))
        ready.close()
    watch.close()
    parent = multiprocessing.parent_process()
    sentinels = [parent.sentinel] if parent is not None else []
    code = 0
    try:
        _busy_loop(worker, reader, response, sentinels)
    except RingGone:
        code = EXIT_PARENT_DIED
    except Exception:
        logger.exception("worker %d: fatal error; exiting", rank)
        code = 1
    finally:
        beats.set()
        response.close()
        reader.close()
    sys.stderr.flush()
    os._exit(code)


def _busy_loop(worker: Worker, reader: ShmReader, response: ShmWriter,
               sentinels: list) -> None:
    """Runs RPCs until `shutdown`. A failing RPC is fatal for the worker: the other ranks may
    be waiting for it in an all-reduce, so it answers the error (when asked) and exits; its
    exit is what the executor's monitor turns into ENGINE_CORE_DEAD."""
    while True:
        call, arg = m.decode_call(reader.get(sentinels))
        try:
            result = getattr(worker, call.method)(arg)
        except Exception as e:
            if call.reply_rank in (m.ALL_RANKS, worker.rank):
                response.put(m.encode_reply(worker.rank, call.method,
                                            error=f"{type(e).__name__}: {e}"), sentinels)
            raise
        if call.reply_rank in (m.ALL_RANKS, worker.rank):
            response.put(m.encode_reply(worker.rank, call.method, result), sentinels)
        if call.method == "shutdown":
            return
