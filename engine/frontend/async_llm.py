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

from engine.client import make_client
from engine.client.async_mp_client import cancel_task
from engine.client.base import EngineCoreClient, EngineDeadError
from engine.config import EngineConfig
from engine.frontend.input_processor import InputProcessor, PromptType
from engine.frontend.output_processor import (
    OutputProcessor,
    ParentRequest,
    RequestOutputCollector,
)
from engine.frontend.outputs import RequestOutput
from engine.kv_connector import kv_params_validator
from engine.models.arch import load_arch
from engine.models.tokenizer import Tokenizer
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
        client: EngineCoreClient | None = None,
    ) -> None:
        self.config = config
        self.model_name = config.model_name
        self.tokenizer = Tokenizer.from_dir(config.model)
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
        self._requests: dict[str, list[str]] = {}  # external id -> internal core ids
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
    ) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request until it finishes (finished=True last)."""
        self._raise_if_dead()
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        request, prompt_text = self.input_processor.process(
            request_id, prompt, sampling_params, kv_transfer_params=kv_transfer_params)
        params = request.sampling_params
        collector = RequestOutputCollector(params.output_kind, request_id)
        if params.n == 1:
            parent, children = None, [request]
        else:
            parent = ParentRequest(request, external_req_id=request_id)
            children = parent.fan_out()
        for index, child in enumerate(children):
            self.output_processor.add_request(child, prompt_text, parent, index,
                                              queue=collector, external_req_id=request_id)
        self._requests[request_id] = [c.request_id for c in children]
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
            if self._requests.get(request_id) is not None and not finished:
                # Cancelled, closed early, or failed: nothing may keep running in the core.
                logger.debug("request %s: consumer gone before the end; aborting", request_id)
                self.abort(request_id)
            self._requests.pop(request_id, None)

    def abort(self, request_id: str) -> asyncio.Future:
        """Abort a request (all its children) here and in the core.

        The frontend side happens at once; the returned future completes once the abort was
        sent to the core (awaiting it is optional). Unknown ids are ignored.
        """
        ids = self._requests.pop(request_id, None)
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
                            processed.iteration_stats)

    def _log_stats(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        for stat_logger in self.stat_loggers:
            try:
                stat_logger(scheduler_stats=scheduler_stats, iteration_stats=iteration_stats)
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
