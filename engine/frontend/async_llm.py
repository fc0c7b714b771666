"""AsyncLLM: the asyncio frontend of one engine (what the API server drives).

Everything runs on one event loop: `generate()` callers, and one output-handler task that
pulls EngineCoreOutputs from the client, turns them into RequestOutputs (OutputProcessor) and
hands each to its request's RequestOutputCollector.

Invariants:
- Bad input is a ValueError raised by `generate()` before any output and before anything is
  sent to the core.
- A request the consumer stops reading (cancellation, `aclose()`, garbage collection) is
  aborted in the core, every child of an n > 1 request included.
- When the engine dies, every running `generate()` raises EngineDeadError, and so does every
  later call (`check_health()` too).
- Stat loggers are called on the loop thread as `logger(scheduler_stats=..., iteration_stats=...)`
  after every batch of outputs; a failing logger is logged and never stops the handler.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from engine.client import make_client
from engine.client.async_mp_client import cancel_task
from engine.client.base import AsyncEngineCoreClient, EngineDeadError
from engine.config import EngineConfig
from engine.connector_registry import kv_params_validator, spec_for
from engine.dp.config import check_request_rank
from engine.frontend.input_processor import (
    InputProcessor,
    PromptType,
    make_internal_request_id,
)
from engine.frontend.output_processor import (
    OutputProcessor,
    ParentRequest,
    RequestOutputCollector,
)
from engine.frontend.outputs import RequestOutput
from engine.models.formats import load_arch, load_tokenizer
from engine.protocol import EngineCoreOutputs, SamplingParams

logger = logging.getLogger(__name__)

StatLogger = Callable[..., Any]
_CHUNK = 256  # outputs processed between yields to the loop, so generate() tasks stay live


class AsyncLLM:
    def __init__(
        self,
        config: EngineConfig,
        *,
        multiprocess: bool = True,
        stat_loggers: list[StatLogger] | None = None,
        client: AsyncEngineCoreClient | None = None,
    ) -> None:
        self.config = config
        self.model_name = config.model_name
        self.tokenizer = load_tokenizer(config.model)
        arch = load_arch(config.model)
        self.max_model_len = config.resolved_max_model_len(arch.max_position_embeddings)
        eos = arch.eos_token_ids[0] if arch.eos_token_ids else self.tokenizer.eos_token_id
        self.input_processor = InputProcessor(
            self.tokenizer, self.max_model_len, eos, arch.vocab_size,
            kv_params_validator=kv_params_validator(config))
        self.output_processor = OutputProcessor(self.tokenizer, log_stats=True)
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self.client = client or make_client(config, multiprocess=multiprocess,
                                            asyncio_mode=True)
        # internal id -> (caller's id, core ids of its children); never keyed by the caller's
        # id, which clients may reuse
        self._requests: dict[str, tuple[str, list[str]]] = {}
        self._handler: asyncio.Task | None = None
        self._background: set[asyncio.Future] = set()
        self._dead: EngineDeadError | None = None
        self._shut_down = False

    @classmethod
    def from_config(cls, config: EngineConfig, *, multiprocess: bool = True,
                    stat_loggers: list[StatLogger] | None = None) -> AsyncLLM:
        return cls(config, multiprocess=multiprocess, stat_loggers=stat_loggers)

    # -- state ----------------------------------------------------------------------------
    @property
    def num_kv_blocks(self) -> int:
        return self.client.num_kv_blocks

    @property
    def dead_error(self) -> EngineDeadError | None:
        client_dead = getattr(self.client, "dead_error", None)
        return self._dead or client_dead

    @property
    def dead_data_parallel_ranks(self) -> list[int]:
        """The data-parallel ranks whose engine died (always empty without DP)."""
        return sorted(getattr(self.client, "engine_errors", ()))

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def is_running(self) -> bool:
        return not self._shut_down and not self.errored

    async def check_health(self) -> None:
        """Raises EngineDeadError when the engine is gone."""
        if (err := self.dead_error) is not None:
            raise EngineDeadError(str(err))

    def _raise_if_dead(self) -> None:
        if (err := self.dead_error) is not None:
            raise EngineDeadError(str(err))

    # -- requests -------------------------------------------------------------------------
    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        kv_transfer_params: dict[str, Any] | None = None,
        internal_request_id: str | None = None,
        data_parallel_rank: int | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request until it finishes (finished=True last).

        `request_id` is the caller's id: outputs carry it, and several requests may share it
        (a client reusing an X-Request-Id). The engine tracks each request by its internal id,
        `internal_request_id` or `make_internal_request_id(request_id)` (the caller's id plus
        8 hex characters, which KV peers strip to pair P and D); it must be unique among the
        requests in flight. Pass it to `abort` to end exactly this request.
        `data_parallel_rank` pins the request to that DP engine (ValueError if out of range)."""
        self._raise_if_dead()
        check_request_rank(self.config, data_parallel_rank)
        if internal_request_id is None:
            internal_request_id = self._fresh_internal_id(request_id)
        elif internal_request_id in self._requests:
            raise ValueError(f"internal request id {internal_request_id!r} is already in use")
        request, prompt_text = self.input_processor.process(
            request_id, prompt, sampling_params, kv_transfer_params=kv_transfer_params,
            internal_request_id=internal_request_id)
        if data_parallel_rank is not None:
            request = msgspec.structs.replace(request, data_parallel_rank=data_parallel_rank)
        key = request.request_id
        params = request.sampling_params
        collector = RequestOutputCollector(params.output_kind, request_id)
        if params.n == 1:
            parent, children = None, [request]
        else:
            parent = ParentRequest(request, external_req_id=request_id,
                                   kv_spec=spec_for(self.config))
            children = parent.fan_out()
        for index, child in enumerate(children):
            self.output_processor.add_request(child, prompt_text, parent, index,
                                              queue=collector, external_req_id=request_id)
        self._requests[key] = (request_id, [c.request_id for c in children])
        self._ensure_output_handler()
        finished = False
        try:
            for child in children:
                await self.client.add_request_async(child)
            while not finished:
                out = collector.get_nowait() or await collector.get()
                finished = out.finished
                yield out
        finally:
            if self._requests.get(key) is not None and not finished:
                # Cancelled, closed early, or failed: nothing may keep running in the core.
                logger.debug("request %s (%s): consumer gone before the end; aborting",
                             key, request_id)
                self.abort(key)
            self._requests.pop(key, None)

    def _fresh_internal_id(self, request_id: str) -> str:
        while True:
            internal = make_internal_request_id(request_id)
            if internal not in self._requests:
                return internal

    def abort(self, request_id: str) -> asyncio.Future:
        """Abort a request (all its children) here and in the core.

        `request_id` is an internal id (as given to or made by `generate`: exactly that
        request), else a caller's id: every request in flight under it. The frontend side
        happens at once; the returned future completes once the abort was sent to the core
        (awaiting it is optional). Unknown ids are ignored.
        """
        if request_id in self._requests:
            keys = [request_id]
        else:
            keys = [k for k, (ext, _) in self._requests.items() if ext == request_id]
        ids = [cid for k in keys for cid in self._requests.pop(k)[1]]
        core_ids = self.output_processor.abort_requests(ids) if ids else []
        return self._abort_in_core(core_ids)

    def _abort_in_core(self, core_ids: list[str]) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        if not core_ids or self.errored or self._shut_down:
            fut = loop.create_future()
            fut.set_result(None)
            return fut
        task = loop.create_task(self.client.abort_requests_async(core_ids))
        self._background.add(task)
        task.add_done_callback(self._background_done)
        return task

    def _background_done(self, task: asyncio.Future) -> None:
        self._background.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            if not isinstance(exc, EngineDeadError):
                logger.warning("abort in the engine core failed: %s", exc)

    # -- output handler ---------------------------------------------------------------------
    def _ensure_output_handler(self) -> None:
        if self._handler is None:
            self._handler = asyncio.get_running_loop().create_task(
                self._output_handler(), name="AsyncLLMOutputHandler")

    async def _output_handler(self) -> None:
        try:
            while True:
                outputs = await self.client.get_output_async()
                await self._process(outputs)
        except asyncio.CancelledError:
            raise
        except EngineDeadError as e:
            self._fail_all(e)
        except Exception as e:
            logger.exception("AsyncLLM output handler failed")
            self._fail_all(EngineDeadError(f"output handler failed: {type(e).__name__}: {e}"))

    async def _process(self, outputs: EngineCoreOutputs) -> None:
        batch = outputs.outputs
        for start in range(0, max(len(batch), 1), _CHUNK):
            if start:
                await asyncio.sleep(0)
            processed = self.output_processor.process_outputs(
                batch[start:start + _CHUNK], outputs.timestamp)
            if processed.reqs_to_abort:
                self._abort_in_core(processed.reqs_to_abort)
            last = start + _CHUNK >= len(batch)
            self._log_stats(outputs.scheduler_stats if last else None,
                            processed.iteration_stats, outputs.engine_index)

    def _log_stats(self, scheduler_stats: Any, iteration_stats: Any,
                   engine_index: int = 0) -> None:
        for stat_logger in self.stat_loggers:
            try:
                stat_logger(scheduler_stats=scheduler_stats, iteration_stats=iteration_stats,
                            engine_index=engine_index)
            except Exception:
                logger.exception("stat logger %r failed", stat_logger)

    def _fail_all(self, error: EngineDeadError) -> None:
        if self._dead is None:
            self._dead = error
            logger.error("engine dead: %s; failing %d request(s)", error, len(self._requests))
        self.output_processor.propagate_error(error)
        self._requests.clear()

    # -- utilities ----------------------------------------------------------------------------
    async def reset_prefix_cache(self) -> bool:
        self._raise_if_dead()
        return bool(await self.client.call_utility_async("reset_prefix_cache"))

    async def debug_prompt_kv(self, prompt_token_ids: list[int]) -> list[str]:
        self._raise_if_dead()
        return list(await self.client.call_utility_async("debug_prompt_kv", prompt_token_ids))

    async def get_stats(self) -> dict[str, Any]:
        self._raise_if_dead()
        return dict(await self.client.call_utility_async("get_stats"))

    async def kv_transfer_info(self) -> dict[str, Any]:
        """What the connector's worker halves bound, that GET /kv_transfer/info serves over
        the configured values: the live engine_id, kv_host, kv_port and kv_ports (one per TP
        rank); with data parallel, the top level is rank 0's and `data_parallel_ranks` lists
        each live rank's (`rank` and the same four keys). {} without a connector."""
        self._raise_if_dead()
        by_rank: dict[int | None, list[dict[str, Any]]] = {}
        for b in await self.client.call_utility_async("kv_bindings"):
            by_rank.setdefault(b.get("data_parallel_rank"), []).append(b)
        top = by_rank.get(None) or by_rank.get(0)
        info = _bound_side_channels(top) if top else {}
        ranks = sorted(rank for rank in by_rank if rank is not None)  # data parallel
        if ranks:
            info["data_parallel_ranks"] = [{"rank": r, **_bound_side_channels(by_rank[r])}
                                           for r in ranks]
        return info

    async def get_supported_tasks(self) -> list[str]:
        self._raise_if_dead()
        return list(await self.client.call_utility_async("get_supported_tasks"))

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def detokenize(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    # -- lifecycle ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the engine; running generate() calls end with EngineDeadError. Idempotent."""
        if self._shut_down:
            return
        self._shut_down = True
        if self._handler is not None:
            cancel_task(self._handler)
        try:
            self.output_processor.propagate_error(EngineDeadError("the engine was shut down"))
        except RuntimeError:
            pass  # the loop is gone; nobody can be waiting
        self._requests.clear()
        self.client.shutdown()


def _bound_side_channels(bindings: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's worker-half bindings (in TP rank order) as /kv_transfer/info spells them."""
    first = bindings[0]
    return {"engine_id": first["engine_id"], "kv_host": first["host"], "kv_port": first["port"],
            "kv_ports": [b["port"] for b in bindings]}
