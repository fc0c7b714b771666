"""LLM: the offline API users know from vLLM — `LLM(model=DIR).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import msgspec
from tqdm import tqdm

from engine.client.core_process import refuse_inside_spawn_import
from engine.config import EngineConfig
from engine.frontend.llm_engine import LLMEngine
from engine.frontend.outputs import RequestOutput
from engine.protocol import RequestOutputKind, SamplingParams

PromptType = str | dict[str, Any] | list[int]


class LLM:
    def __init__(self, model: str, *, multiprocess: bool = True, **engine_args: Any) -> None:
        """`multiprocess=True` (default) runs the EngineCore in its own process behind the
        ZeroMQ client, as the servers do; False keeps it on this thread (no spawn cost).

        With multiprocess=True a script must create the LLM under `if __name__ == "__main__":`
        (the spawned core imports the script again); otherwise UnguardedMainError says so.
        """
        if multiprocess:
            refuse_inside_spawn_import()  # before loading anything: fail fast in the child
        self.config = EngineConfig.from_kwargs(model, **engine_args)
        self.engine = LLMEngine(self.config, multiprocess=multiprocess)
        self._counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        data_parallel_rank: int | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order. Bad input raises ValueError
        before any request is queued, so the engine is left as it was.
        `data_parallel_rank` pins every prompt to that DP engine."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"sampling_params has {len(params)} entries for {len(prompts)} prompts"
                )
        final = [msgspec.structs.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                 for p in params]
        ids = [str(next(self._counter)) for _ in prompts]
        added: list[str] = []
        try:
            for rid, prompt, p in zip(ids, prompts, final, strict=True):
                self.engine.add_request(rid, prompt, p,
                                        data_parallel_rank=data_parallel_rank)
                added.append(rid)
        except Exception:
            self.engine.abort_request(added)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            self.engine.abort_request([i for i in ids if i not in done])
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]

    def reset_prefix_cache(self) -> bool:
        return self.engine.call_utility("reset_prefix_cache")

    def get_stats(self) -> dict[str, Any]:
        return self.engine.call_utility("get_stats")

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
