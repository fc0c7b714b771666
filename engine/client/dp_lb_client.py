"""DPLBAsyncClient: one frontend, N EngineCore processes (data parallel, internal balancing).

Seed 000's DP load-balancing client. It starts the coordinator (engine.dp.coordinator), then
one AsyncMPClient per rank (each its own process, sockets and HELLO/READY handshake; engine
index = rank, so outputs and metrics carry the rank). Each request goes to the rank it pins
(`EngineCoreRequest.data_parallel_rank`) or to the least-loaded live rank (engine.dp.balancer,
fed by the coordinator's FrontStats). The client remembers which rank holds each request, so
aborts (and every child of an n > 1 request) reach the right engine.

Death of one engine: its requests end at once with a finished ERROR output naming the rank,
the balancer stops choosing it, a request pinned to it is refused (EngineDeadError → 503),
and the other ranks keep serving. Only when every engine is dead does the client report
itself dead (the server's /health then answers 503). `/engine_stats` lists `dead_engines`.
Death of the coordinator: balancing falls back to this client's own outstanding requests per
engine and serving continues — except with `data_parallel_lockstep`, where engines can no
longer leave a wave: then the client is dead (every request fails, /health 503).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq
import zmq.asyncio

from engine.client.async_mp_client import AsyncMPClient, cancel_task
from engine.client.base import AsyncEngineCoreClient, EngineDeadError, next_output
from engine.config import EngineConfig
from engine.dp.balancer import Balancer
from engine.dp.config import default_request_rank, rank_config
from engine.dp.coordinator import CoordinatorProcess
from engine.dp.messages import DECODE_ERRORS, front_decoder
from engine.dp.stats import merge_stats
from engine.protocol import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason

logger = logging.getLogger(__name__)

_COORDINATOR_POLL_MS = 200
_RANK_DIED = re.compile(r"data-parallel engine \d+ died: ")


def rank_died_message(rank: int, error: BaseException) -> str:
    """The error of a request its rank's death ended (also one added in the moment before
    the death was seen): the server answers it like a dead engine, 503, never 500."""
    return f"data-parallel engine {rank} died: {error}"


def is_rank_death(error: str | None) -> bool:
    """Whether a request's error is `rank_died_message`'s."""
    return error is not None and _RANK_DIED.match(error) is not None


class DPLBAsyncClient(AsyncEngineCoreClient):
    def __init__(self, config: EngineConfig, **kwargs: Any) -> None:
        n = config.data_parallel_size
        self.config = config
        self.lockstep = config.data_parallel_lockstep
        self.coordinator = CoordinatorProcess(n, lockstep=self.lockstep)
        self.engines: list[AsyncMPClient] = []
        try:
            self.engines = _start_engines(config, self.coordinator, kwargs)
        except BaseException:
            self.coordinator.shutdown()
            raise
        self.num_kv_blocks = sum(e.num_kv_blocks for e in self.engines)
        self.max_model_len = self.engines[0].max_model_len
        self.balancer = Balancer(n)
        self.owner: dict[str, int] = {}  # core request id -> rank
        self.engine_errors: dict[int, str] = {}
        self.num_malformed_stats = 0
        self._dead: EngineDeadError | None = None
        self._outputs: asyncio.Queue[EngineCoreOutputs | EngineDeadError] | None = None
        self._tasks: list[asyncio.Task] = []
        self._ctx = zmq.asyncio.Context()
        self._shut_down = False

    # -- state ----------------------------------------------------------------------------
    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead

    def _start(self) -> None:
        if self._outputs is not None:
            return
        loop = asyncio.get_running_loop()
        self._outputs = asyncio.Queue()
        self._tasks = [loop.create_task(self._pump(r), name=f"DPOutputPump_{r}")
                       for r in range(len(self.engines))]
        self._tasks.append(loop.create_task(self._read_stats(), name="DPStatsSubscriber"))

    # -- background tasks ---------------------------------------------------------------
    async def _pump(self, rank: int) -> None:
        try:
            while True:
                outputs = await self.engines[rank].get_output_async()
                for out in outputs.outputs:
                    if out.finished and self.owner.pop(out.request_id, None) is not None:
                        self.balancer.finished(rank)
                self._outputs.put_nowait(outputs)
        except EngineDeadError as e:
            self._engine_died(rank, e)

    def _engine_died(self, rank: int, error: EngineDeadError) -> None:
        if self._shut_down:
            return
        self.balancer.alive[rank] = False
        self.engine_errors[rank] = str(error)
        lost = [rid for rid, r in self.owner.items() if r == rank]
        for rid in lost:
            del self.owner[rid]
        logger.error("data-parallel engine %d died (%s); failing its %d request(s), %d "
                     "engine(s) still serving", rank, error, len(lost), sum(self.balancer.alive))
        message = rank_died_message(rank, error)
        if lost:
            self._outputs.put_nowait(EngineCoreOutputs(
                engine_index=rank, timestamp=time.time(),
                outputs=[EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR,
                                          error=message) for rid in lost]))
        if not any(self.balancer.alive):
            self._mark_dead(EngineDeadError(f"every data-parallel engine is dead; last: "
                                            f"{message}"))

    def _mark_dead(self, error: EngineDeadError) -> None:
        if self._dead is None:
            self._dead = error
            self._outputs.put_nowait(error)

    async def _read_stats(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.coordinator.addresses.front_pub)
        try:
            while True:
                if await sub.poll(timeout=_COORDINATOR_POLL_MS):
                    self._on_stats(await sub.recv())
                elif not self.coordinator.alive:
                    self._coordinator_died()
                    return
        finally:
            sub.close(linger=0)

    def _on_stats(self, data: bytes) -> None:
        try:
            msg = front_decoder.decode(data)
            self.balancer.publish(msg.counts, msg.stamps)
        except (*DECODE_ERRORS, ValueError) as e:
            self.num_malformed_stats += 1
            logger.warning("dropped a malformed coordinator message: %s", e)

    def _coordinator_died(self) -> None:
        if self._shut_down:
            return
        self.balancer.have_coordinator = False
        logger.error("the data-parallel coordinator (pid %s) exited with code %s",
                     self.coordinator.proc.pid, self.coordinator.proc.exitcode)
        if self.lockstep:
            self._mark_dead(EngineDeadError("the data-parallel coordinator died; lockstep "
                                            "engines cannot run request waves without it"))
        else:
            logger.warning("balancing on this server's own outstanding requests from now on")

    # -- requests -------------------------------------------------------------------------
    def _ensure_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))

    def _rank_for(self, request: EngineCoreRequest) -> int:
        rank = request.data_parallel_rank
        if rank is None:
            rank = default_request_rank(self.config, request.kv_transfer_params)
        if rank is None:
            try:
                return self.balancer.pick()
            except LookupError as e:
                raise EngineDeadError(str(e)) from None
        if not 0 <= rank < len(self.engines):
            raise ValueError(f"data_parallel_rank {rank} is out of range "
                             f"(data_parallel_size {len(self.engines)})")
        if not self.balancer.alive[rank]:
            raise EngineDeadError(f"data-parallel engine {rank} is dead: "
                                  f"{self.engine_errors.get(rank, '')}")
        return rank

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._start()
        self._ensure_alive()
        rank = self._rank_for(request)
        self.owner[request.request_id] = rank
        self.balancer.sent(rank)
        try:
            await self.engines[rank].add_request_async(request)
        except BaseException:
            if self.owner.pop(request.request_id, None) is not None:
                self.balancer.finished(rank)
            raise

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self._start()
        by_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            rank = self.owner.pop(rid, None)
            if rank is not None:
                self.balancer.finished(rank)
                by_rank.setdefault(rank, []).append(rid)
        for rank, ids in by_rank.items():
            if self.balancer.alive[rank]:
                try:
                    await self.engines[rank].abort_requests_async(ids)
                except EngineDeadError:
                    pass  # its death fails those requests anyway

    def rank_of(self, request_id: str) -> int | None:
        return self.owner.get(request_id)

    async def get_output_async(self) -> EngineCoreOutputs:
        self._start()
        return await next_output(self._outputs)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Runs on every live engine. get_stats: sums plus `engines` (per rank) and
        `dead_engines`; reset_prefix_cache: True when every engine reset; kv_bindings: every
        live rank's, in rank order, each naming its `data_parallel_rank`; else rank 0's
        (the first live rank's) answer."""
        self._start()
        self._ensure_alive()
        live = [r for r, ok in enumerate(self.balancer.alive) if ok]
        results = await asyncio.gather(
            *(self.engines[r].call_utility_async(method, *args) for r in live),
            return_exceptions=True)
        answers = {}
        for r, res in zip(live, results, strict=True):
            if isinstance(res, EngineDeadError):
                continue  # died meanwhile; its pump reports it
            if isinstance(res, BaseException):
                raise res
            answers[r] = res
        if not answers:
            raise EngineDeadError("no data-parallel engine answered")
        if method == "get_stats":
            return merge_stats(answers, self)
        if method == "reset_prefix_cache":
            return all(answers.values())
        if method == "kv_bindings":  # each rank bound its own side channels (/kv_transfer/info)
            return [{**b, "data_parallel_rank": r} for r in sorted(answers) for b in answers[r]]
        return answers[min(answers)]

    # -- lifecycle ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._shut_down:
            return
        self._shut_down = True
        for task in self._tasks:
            cancel_task(task)
        with ThreadPoolExecutor(max(1, len(self.engines))) as pool:
            list(pool.map(lambda e: e.shutdown(), self.engines))
        self.coordinator.shutdown()
        self._ctx.destroy(linger=0)


def _start_engines(config: EngineConfig, coordinator: CoordinatorProcess,
                   kwargs: dict[str, Any]) -> list[AsyncMPClient]:
    """All ranks start at once (each waits for its own READY); on any failure the started
    ones are shut down and the first error is raised."""
    n = config.data_parallel_size
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(AsyncMPClient, rank_config(config, r), engine_index=r,
                               coordinator=coordinator.addresses, **kwargs) for r in range(n)]
        started, errors = [], []
        for fut in futures:
            try:
                started.append(fut.result())
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)
    if errors:
        for client in started:
            client.shutdown()
        raise errors[0]
    return started
