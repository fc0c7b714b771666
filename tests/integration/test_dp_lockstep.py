"""Request waves (`data_parallel_lockstep`): engines that must step together. Real engine
processes and coordinator through `LLM(data_parallel_size=2, ...)`; waits on the engines'
own wave state (get_stats), never on sleeps."""

from __future__ import annotations

import os
import signal

import pytest
from pd_harness import wait_until

from engine import LLM, SamplingParams
from engine.client.base import EngineDeadError

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _engines(llm: LLM) -> dict:
    return llm.get_stats()["engines"]


def _wave_over(llm: LLM, wave: int) -> bool:
    return all(e["dp_wave"] == wave and not e["dp_engines_running"]
               for e in _engines(llm).values())


def test_lockstep_waves_make_idle_ranks_step(tiny_model):
    prompts = [{"prompt_token_ids": [3 + i, 9, 27, 81 % (i + 2)]} for i in range(4)]
    ref_llm = LLM(tiny_model, multiprocess=False, num_kv_blocks=64, max_model_len=256)
    try:
        ref = [o.outputs[0].token_ids for o in ref_llm.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        ref_llm.shutdown()
    llm = LLM(tiny_model, data_parallel_size=2, data_parallel_lockstep=True, num_kv_blocks=64,
              max_model_len=256)
    try:
        assert _wave_over(llm, 0)
        out = llm.generate(prompts[:1], GREEDY, use_tqdm=False, data_parallel_rank=0)
        assert out[0].outputs[0].token_ids == ref[0]
        wait_until(lambda: _wave_over(llm, 1), 10, "wave 0 complete on both ranks")
        e = _engines(llm)
        # Rank 1 had no request, yet stepped (dummy steps) while rank 0 worked.
        assert e["1"]["num_dummy_steps"] > 0 and e["1"]["num_waves_started"] == 0
        assert e["0"]["num_waves_started"] == 1
        idle_steps = e["1"]["num_dummy_steps"]
        assert _engines(llm)["1"]["num_dummy_steps"] == idle_steps  # no stepping between waves
        # A request on rank 1 starts the next wave; rank 0 joins it.
        llm.generate(prompts[1:2], GREEDY, use_tqdm=False, data_parallel_rank=1)
        wait_until(lambda: _wave_over(llm, 2), 10, "wave 1 complete on both ranks")
        assert _engines(llm)["0"]["num_dummy_steps"] > 0
        # Unpinned, both ranks: greedy outputs equal the single engine's.
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)
                ] == ref
        wait_until(lambda: _wave_over(llm, _engines(llm)["0"]["dp_wave"]), 10, "waves end")
        # Without the coordinator no wave can end: a lockstep server is dead, at once.
        os.kill(llm.get_stats()["dp_coordinator_pid"], signal.SIGKILL)
        wait_until(lambda: llm.engine.client.dead_error is not None, 10, "client dead")
        with pytest.raises(EngineDeadError, match="coordinator died"):
            llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
