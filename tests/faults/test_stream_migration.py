"""Streams that survive a dead D (issue 30 part 4): real engines, real NIXL push, a real
SIGKILL. 1P2D behind one proxy; 8 concurrent streamed greedy requests (6 completions, 2 chats
whose client asks for return_token_ids itself); once every stream has tokens, a D still
decoding some of them is SIGKILLed. Every stream completes without an error, each equal (text
and usage) to the colocated answer; the migrations are counted; the surviving engines hold no
block and no table entry afterwards. With --retries 0 (no migration: the old relay) streams
end with a decode_failed error event."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import threading
import time
from typing import Any

import httpx
import pytest
from fault_kit import signal_all
from pd_harness import assert_no_leaks, deployment, engine_stats, metric, wait_until

from engine import LLM, SamplingParams
from pdserve.launcher import ServerProcess

MAX_TOKENS = 900  # long enough that the kill lands mid-stream (max-model-len 1024)
STREAMS = 8
CHATS = 2  # the last CHATS streams are chats
MIGRATIONS = "pdserve:proxy_migrations_total"
GENERATED = "pdserve:generation_tokens_total"


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 2000) for _ in range(rng.randint(20, 60))] for _ in range(n)]


@pytest.fixture(scope="module")
def pd(tiny_model: str):
    with deployment(tiny_model, "push", num_decodes=2, num_blocks=1024) as dep:
        yield dep


def _reference(model: str, prompts: list[list[int]]) -> list[str]:
    llm = LLM(model, num_kv_blocks=1024, max_model_len=1024, multiprocess=False)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        return [o.outputs[0].text for o in outs]
    finally:
        llm.shutdown()


class Stream:
    def __init__(self) -> None:
        self.text: list[str] = []
        self.events: list[dict[str, Any]] = []
        self.stamps: list[float] = []  # arrival of each event
        self.error: str | None = None
        self.done = False
        self.prompt_ids: list[int] | None = None  # chat: as the first chunk reported them


async def _stream(url: str, prompt: list[int], out: Stream, chat: bool) -> None:
    body: dict[str, Any] = {"model": "m", "max_tokens": MAX_TOKENS, "temperature": 0.0,
                            "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}
    if chat:
        body.update(messages=[{"role": "user", "content": f"the cache {prompt[0]}"}],
                    return_token_ids=True)
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        async with httpx.AsyncClient(timeout=120) as c, c.stream(
                "POST", url + path, json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out.done = True
                    break
                event = json.loads(line[len("data: "):])
                out.events.append(event)
                out.stamps.append(time.monotonic())
                if "error" in event:
                    out.error = str(event["error"])
                elif event["choices"]:
                    choice = event["choices"][0]
                    out.prompt_ids = out.prompt_ids or event.get("prompt_token_ids")
                    out.text.append(choice["delta"].get("content", "") if chat
                                    else choice["text"])
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"


def test_streams_survive_a_sigkilled_decode(pd, tiny_model):
    prompts = _prompts(STREAMS, seed=30)
    streams = [Stream() for _ in prompts]
    before = metric(pd.proxy, MIGRATIONS)
    gen0 = [metric(d, GENERATED) for d in pd.decodes]

    async def run() -> None:
        await asyncio.gather(*(_stream(pd.proxy.url, p, s, i >= STREAMS - CHATS)
                               for i, (p, s) in enumerate(zip(prompts, streams, strict=True))))

    runner = threading.Thread(target=lambda: asyncio.run(run()))
    runner.start()
    try:
        # every stream has started, and a D that generated tokens of its own still holds
        # unfinished requests: the one to kill mid-stream (a fast D can finish its streams
        # before the last prompt's prefill gives that stream its first token; the proxy
        # spreads streams by load, so either D may be the one)
        victims: list[ServerProcess] = []

        def decoding() -> bool:
            if not all(s.text for s in streams):
                return False
            victims[:] = [d for d, g0 in zip(pd.decodes, gen0, strict=True)
                          if metric(d, GENERATED) - g0 >= 16
                          and engine_stats(d)["num_unfinished_requests"] > 0][:1]
            return bool(victims)

        wait_until(decoding, 120, "every stream started and a D decoding")
        victim = victims[0]
        survivor = next(d for d in pd.decodes if d is not victim)
        signal_all(victim, signal.SIGKILL)
    finally:
        runner.join(180)
    assert not runner.is_alive()
    for s in streams[STREAMS - CHATS:]:
        assert s.prompt_ids, "a chat client that asked return_token_ids got the prompt's ids"
    prompts[STREAMS - CHATS:] = [s.prompt_ids for s in streams[STREAMS - CHATS:]]
    expected = _reference(tiny_model, prompts)
    for i, (s, want) in enumerate(zip(streams, expected, strict=True)):
        assert s.error is None and s.done, f"stream {i}: {s.error}"
        assert "".join(s.text) == want, f"stream {i} differs from the colocated answer"
        usage = s.events[-1]["usage"]
        assert usage["prompt_tokens"] == len(prompts[i]), usage
        assert usage["completion_tokens"] == MAX_TOKENS, usage
        if i < STREAMS - CHATS:
            assert all("token_ids" not in c and "prompt_token_ids" not in c
                       for e in s.events for c in e.get("choices", [])), "ids leaked"
    migrated = metric(pd.proxy, MIGRATIONS) - before
    assert migrated >= 1
    gap = max(b - a for s in streams for a, b in zip(s.stamps, s.stamps[1:], strict=False))
    print(f"\nmigrated streams: {migrated:g}; longest gap between two events: "
          f"{gap * 1e3:.0f} ms")  # the seam: kill, broken stream, new leg's prefill
    text = httpx.get(pd.proxy.url + "/metrics", timeout=10).text
    assert 'pdserve:proxy_migrations_total{reason="' in text
    assert_no_leaks([pd.p, survivor], timeout=40)
