"""AsyncLLM over a real EngineCore process (AsyncMPClient, ZeroMQ)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
import pytest

from engine.client.base import EngineDeadError
from engine.config import EngineConfig
from engine.frontend.async_llm import AsyncLLM
from engine.frontend.llm import LLM
from engine.protocol import RequestOutputKind, SamplingParams

NUM_BLOCKS = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def config(tiny_model: str) -> EngineConfig:
    return EngineConfig(model=tiny_model, num_kv_blocks=NUM_BLOCKS, max_model_len=256)


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def stats_seen() -> list[tuple]:
    return []


@pytest.fixture(scope="module")
def llm(config, loop, stats_seen):
    engine = AsyncLLM.from_config(
        config, stat_loggers=[lambda **kw: stats_seen.append(
            (kw["scheduler_stats"], kw["iteration_stats"]))])
    yield engine
    engine.shutdown()


async def final(llm: AsyncLLM, prompt, params: SamplingParams, rid: str):
    last = None
    async for out in llm.generate(prompt, params, rid):
        last = out
    assert last is not None and last.finished
    return last


class HeldOutputs:
    """Holds the core's outputs on their way into AsyncLLM: once a batch carrying an output of
    a request whose id starts with `prefix` went through, the output handler waits for
    `release()`. A test then acts on that request's first outputs (cancel, abort, close)
    while the frontend has seen no more of it, however fast the core decodes: without the
    hold a starved test process could find a 200-token request already finished. The core runs
    on; what it makes meanwhile waits in the client's queue."""

    def __init__(self, llm: AsyncLLM, prefix: str) -> None:
        self.client, self.prefix = llm.client, prefix
        self.real = llm.client.get_output_async
        self.open = asyncio.Event()
        self.open.set()
        self.client.get_output_async = self.get  # the handler's next fetch comes here

    async def get(self):
        await self.open.wait()
        out = await self.real()
        if any(o.request_id.startswith(self.prefix) for o in out.outputs):
            self.open.clear()
        return out

    def release(self) -> None:
        self.open.set()
        self.client.get_output_async = self.real


async def wait_idle(llm: AsyncLLM, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = await llm.get_stats()
        if (stats["num_unfinished_requests"] == 0 and stats["num_free_blocks"] == NUM_BLOCKS
                and stats["num_runner_requests"] == 0):
            return stats
        assert time.monotonic() < deadline, f"engine not idle: {stats}"
        await asyncio.sleep(0.05)


def test_concurrent_generates_match_the_in_process_path_token_for_token(llm, loop, config):
    prompts = ["hello world", "the quick brown fox", {"prompt_token_ids": [5, 6, 7, 8, 9]},
               [11, 12, 13]]

    async def run():
        return await asyncio.gather(*(final(llm, p, GREEDY, f"c{i}")
                                      for i, p in enumerate(prompts)))

    outs = loop.run_until_complete(run())
    assert [o.request_id for o in outs] == [f"c{i}" for i in range(len(prompts))]
    offline = LLM(config.model, num_kv_blocks=NUM_BLOCKS, max_model_len=256)
    try:
        expected = offline.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        offline.engine.shutdown()
    for got, want in zip(outs, expected, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].text == want.outputs[0].text
        assert got.outputs[0].finish_reason == "length"
    loop.run_until_complete(wait_idle(llm))


def test_bad_input_raises_value_error_before_any_output(llm, loop):
    async def run(prompt, params):
        async for _ in llm.generate(prompt, params, "bad"):
            pytest.fail("no output expected")

    with pytest.raises(ValueError, match="out of vocabulary"):
        loop.run_until_complete(run([10**7], GREEDY))
    with pytest.raises(ValueError, match="max_model_len"):
        loop.run_until_complete(run("hi", SamplingParams(max_tokens=10_000)))
    assert loop.run_until_complete(llm.get_stats())["num_unfinished_requests"] == 0


def test_cancelled_consumer_aborts_the_request_in_the_core(llm, loop):
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def run():
        got, held = asyncio.Event(), HeldOutputs(llm, "cancelled")

        async def consume():
            async for _ in llm.generate("cancel me please", long, "cancelled"):
                got.set()

        try:
            task = asyncio.create_task(consume())
            await asyncio.wait_for(got.wait(), 30)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            held.release()
        return await wait_idle(llm)

    stats = loop.run_until_complete(run())
    assert stats["num_runner_requests"] == 0
    assert "cancelled" not in llm._requests


def test_closing_the_stream_early_aborts_every_child_of_n2(llm, loop):
    params = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=200, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)

    async def run():
        held = HeldOutputs(llm, "closed")
        try:
            gen = llm.generate([1, 2, 3, 4], params, "closed")
            first = await gen.__anext__()
            assert not first.finished
            await gen.aclose()
        finally:
            held.release()
        return await wait_idle(llm)

    loop.run_until_complete(run())


def test_n2_returns_two_samples_and_greedy_children_agree_with_n1(llm, loop):
    async def run():
        two = await final(llm, "fan out", SamplingParams(temperature=0.0, n=2, max_tokens=5,
                                                          ignore_eos=True), "n2")
        one = await final(llm, "fan out", SamplingParams(temperature=0.0, max_tokens=5,
                                                          ignore_eos=True), "n1")
        sampled = await final(llm, "fan out", SamplingParams(temperature=1.0, seed=7, n=2,
                                                              max_tokens=5, ignore_eos=True),
                              "n2s")
        return two, one, sampled

    two, one, sampled = loop.run_until_complete(run())
    assert two.request_id == "n2" and [c.index for c in two.outputs] == [0, 1]
    assert two.outputs[0].token_ids == two.outputs[1].token_ids == one.outputs[0].token_ids
    assert [len(c.token_ids) for c in sampled.outputs] == [5, 5]
    loop.run_until_complete(wait_idle(llm))


def test_abort_by_request_id_ends_the_stream(llm, loop):
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def run():
        outs, held = [], HeldOutputs(llm, "aborted")
        try:
            async for out in llm.generate([3, 3, 3], long, "aborted"):
                outs.append(out)
                if len(outs) == 1:
                    await llm.abort("aborted")
        finally:
            held.release()
        return outs

    outs = loop.run_until_complete(run())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    loop.run_until_complete(wait_idle(llm))


def test_utilities_and_stat_loggers(llm, loop, stats_seen):
    loop.run_until_complete(final(llm, "stats", GREEDY, "stats"))
    assert loop.run_until_complete(llm.reset_prefix_cache()) is True
    assert loop.run_until_complete(llm.get_supported_tasks()) == ["generate"]
    assert stats_seen, "stat loggers were never called"
    sched = [s for s, _ in stats_seen if s is not None]
    assert sched and sched[-1].num_total_blocks in (0, NUM_BLOCKS)
    assert sum(it.num_generation_tokens for _, it in stats_seen if it is not None) >= 6
    assert llm.is_running and not llm.errored
    loop.run_until_complete(llm.check_health())
    assert llm.max_model_len == 256 and llm.model_name == llm.config.model


def test_engine_death_fails_every_generate_and_later_calls(config):
    async def run():
        llm = AsyncLLM.from_config(config)
        pid = llm.client.core.pid
        try:
            long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
            started, held = asyncio.Event(), HeldOutputs(llm, "d")

            async def consume(rid):
                async for _ in llm.generate([1, 2, 3], long, rid):
                    started.set()

            tasks = [asyncio.create_task(consume(f"d{i}")) for i in range(3)]
            await asyncio.wait_for(started.wait(), 30)
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            held.release()
            results = await asyncio.wait_for(
                asyncio.gather(*tasks, return_exceptions=True), 5)
            assert time.monotonic() - t0 < 2.0
            assert all(isinstance(r, EngineDeadError) for r in results), results
            assert llm.errored and not llm.is_running
            with pytest.raises(EngineDeadError):
                await llm.check_health()
            with pytest.raises(EngineDeadError):
                async for _ in llm.generate("x", long, "after"):
                    pass
            with pytest.raises(EngineDeadError):
                await llm.get_stats()
        finally:
            llm.shutdown()
        return pid

    pid = asyncio.run(run())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_in_process_async_engine_gives_the_same_tokens_and_aborts(llm, loop, config):
    prompts = ["in process", [9, 8, 7, 6]]

    async def run(engine, tag):
        return await asyncio.gather(*(final(engine, p, GREEDY, f"{tag}{i}")
                                      for i, p in enumerate(prompts)))

    want = loop.run_until_complete(run(llm, "mp"))

    async def inproc():
        engine = AsyncLLM.from_config(config, multiprocess=False)
        try:
            got = await run(engine, "ip")
            long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
            gen = engine.generate([1, 2], long, "ip-abort")
            await gen.__anext__()
            await gen.aclose()
            return got, await wait_idle(engine)
        finally:
            engine.shutdown()

    got, _ = asyncio.run(inproc())
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]


def test_requests_sharing_a_caller_id_each_finish_and_abort_only_themselves(llm, loop):
    """The caller's id is a label: a reused one is no error, and aborting one request by its
    internal id leaves the other request with the same label running to its end."""
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def run():
        short_a = final(llm, [5, 6, 7], GREEDY, "same")
        short_b = final(llm, [9, 8, 7, 6], GREEDY, "same")
        a, b = await asyncio.gather(short_a, short_b)
        outs: dict[str, list] = {"victim": [], "survivor": []}
        held = HeldOutputs(llm, "same-0000000a")

        async def consume(name: str, internal: str) -> None:
            async for out in llm.generate([3, 3, 3], long, "same", internal_request_id=internal):
                outs[name].append(out)
                if name == "victim" and len(outs[name]) == 1:
                    llm.abort("same-0000000a")
                    held.release()

        try:
            await asyncio.gather(consume("victim", "same-0000000a"),
                                 consume("survivor", "same-0000000b"))
        finally:
            held.release()
        return a, b, outs

    a, b, outs = loop.run_until_complete(run())
    assert a.request_id == b.request_id == "same"
    assert len(a.outputs[0].token_ids) == len(b.outputs[0].token_ids) == 6
    assert outs["victim"][-1].outputs[0].finish_reason == "abort"
    survivor = outs["survivor"][-1]
    assert survivor.finished and survivor.outputs[0].finish_reason == "length"
    assert len(survivor.outputs[0].token_ids) == 40  # cumulative outputs
    loop.run_until_complete(wait_idle(llm))
