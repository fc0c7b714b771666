"""LLMEngine: the synchronous frontend — input processing, an EngineCore client, outputs."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from engine.client.base import SyncEngineCoreClient
from engine.config import EngineConfig
from engine.connector_registry import kv_params_validator, spec_for
from engine.dp.config import check_request_rank
from engine.frontend.input_processor import InputProcessor
from engine.frontend.output_processor import OutputProcessor, ParentRequest
from engine.frontend.outputs import RequestOutput
from engine.models import load_arch, load_tokenizer
from engine.protocol import SamplingParams


def make_engine_client(config: EngineConfig, multiprocess: bool) -> SyncEngineCoreClient:
    if multiprocess:
        from engine.client import make_client

        return make_client(config, multiprocess=True, asyncio_mode=False)
    from engine.client.inproc import InprocClient

    return InprocClient(config)


class LLMEngine:
    """add_request / step / abort_request. Not thread-safe: one caller thread."""

    def __init__(self, config: EngineConfig, *, multiprocess: bool = False) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.model)
        arch = load_arch(config.model)
        self.max_model_len = config.resolved_max_model_len(arch.max_position_embeddings)
        eos = arch.eos_token_ids[0] if arch.eos_token_ids else self.tokenizer.eos_token_id
        self.input_processor = InputProcessor(
            self.tokenizer, self.max_model_len, eos, arch.vocab_size,
            kv_params_validator=kv_params_validator(config),
        )
        self.output_processor = OutputProcessor(self.tokenizer, log_stats=False)
        self.client = make_engine_client(config, multiprocess)
        self._internal_ids: dict[str, list[str]] = {}  # external id -> core ids

    @property
    def num_kv_blocks(self) -> int:
        return self.client.num_kv_blocks

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams,
                    kv_transfer_params: dict[str, Any] | None = None,
                    data_parallel_rank: int | None = None) -> None:
        if request_id in self._internal_ids:
            raise ValueError(f"request_id {request_id!r} is already in use")
        check_request_rank(self.config, data_parallel_rank)
        request, prompt_text = self.input_processor.process(
            request_id, prompt, params, kv_transfer_params=kv_transfer_params
        )
        if data_parallel_rank is not None:
            request = msgspec.structs.replace(request, data_parallel_rank=data_parallel_rank)
        if params.n == 1:
            children, parent = [request], None
        else:
            parent = ParentRequest(request, external_req_id=request_id,
                                   kv_spec=spec_for(self.config))
            children = parent.fan_out()
        for index, child in enumerate(children):
            self.output_processor.add_request(
                child, prompt_text, parent, index, external_req_id=request_id
            )
        for child in children:
            self.client.add_request(child)
        self._internal_ids[request_id] = [c.request_id for c in children]

    def step(self) -> list[RequestOutput]:
        outputs = self.client.get_output()
        processed = self.output_processor.process_outputs(outputs.outputs, outputs.timestamp)
        if processed.reqs_to_abort:
            self.client.abort_requests(processed.reqs_to_abort)
        for out in processed.request_outputs:
            if out.finished:
                self._internal_ids.pop(out.request_id, None)
        return processed.request_outputs

    def abort_request(self, request_ids: Iterable[str]) -> None:
        core_ids: list[str] = []
        for rid in request_ids:
            core_ids += self._internal_ids.pop(rid, [])
        core_ids = self.output_processor.abort_requests(core_ids)
        self.client.abort_requests(core_ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def call_utility(self, method: str, *args: Any) -> Any:
        return self.client.call_utility(method, *args)

    def shutdown(self) -> None:
        self.client.shutdown()
