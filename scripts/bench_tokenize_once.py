"""What the proxy's tokenize-once costs (issue 28: D encodes no prompt; proxy/routing.py).

For prompts of about 128, 1k and 8k tokens of the model's tokenizer, completions (a text
prompt) and chat (the engine's template): the proxy's tokenization (Router.tokenize, the
engine's own code path), the event loop's longest stall while one request is tokenized
(inline below THREAD_MIN_CHARS characters, on the proxy-tokenize thread above), and what the
ids cost on the legs (JSON bytes, the engine's parse of the field). Best of REPEATS runs.

    .venv/bin/python scripts/bench_tokenize_once.py [MODEL] > bench/results/tokenize_once.txt
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from typing import Any

from engine.models.formats import load_tokenizer
from engine.server.openai_protocol import CompletionRequest
from proxy.routing import THREAD_MIN_CHARS, Router

REPEATS = 15
_WORDS = ("the prefill engine writes its cache into the decode engine's memory while the "
          "proxy relays tokens to the client; a request's time to first token is what the "
          "user sees, and every millisecond spent tokenizing twice is waste.").split()


def text_of(tokenizer: Any, target: int, seed: int) -> str:
    """English-like text of about `target` tokens (sentences, with newlines)."""
    rng = random.Random(seed)
    words: list[str] = []
    while True:
        words += [rng.choice(_WORDS) for _ in range(16)] + ["\n"]
        text = " ".join(words)
        if len(tokenizer.encode(text)) >= target:
            return text


def _router(tokenizer: Any) -> Router:
    return Router(None, None, None, None, None, tokenizer)  # type: ignore[arg-type]


def best_ms(fn: Any) -> float:
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


async def _stall_ms(router: Router, body: dict[str, Any], chat: bool, inline: bool) -> float:
    """The longest gap between 1 ms ticks of another task while one request is tokenized:
    as the proxy runs it (`prompt_tokens`), or inline whatever its size."""
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    gaps.clear()
    if not body:  # the noise floor: the same window with nothing to tokenize
        await asyncio.sleep(0.002)
    elif inline:
        router.tokenize(body, chat)
    else:
        await router.prompt_tokens(body, chat)
    await asyncio.sleep(0.003)
    done.set()
    await tick
    return max(gaps) * 1e3


def _median_stall(router: Router, body: dict[str, Any], chat: bool, inline: bool) -> float:
    return statistics.median(asyncio.run(_stall_ms(router, body, chat, inline))
                             for _ in range(5))


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else ".models/bench-llama"
    tokenizer = load_tokenizer(model)
    router = _router(tokenizer)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    print(f"# bench_tokenize_once: model {model}; CPU {cpu}; load {os.getloadavg()}")
    print(f"# THREAD_MIN_CHARS {THREAD_MIN_CHARS}; best of {REPEATS} (stall: median of 5)")
    print("route        tokens  chars   proxy_tokenize_ms  loop_stall_ms(inline)  "
          "loop_stall_ms(as_run)  ids_json_bytes  engine_parse_extra_ms")
    idle = _median_stall(router, {}, False, True)
    print(f"{'(idle)':<12} {0:>6}  {0:>6}  {0:>17.2f}  {idle:>21.2f}  {idle:>21.2f}")
    for target in (128, 1024, 8192):
        text = text_of(tokenizer, target, target)
        for route, body, chat in (
            ("completions", {"model": "m", "prompt": text}, False),
            ("chat", {"model": "m", "messages": [{"role": "user", "content": text}]}, True),
        ):
            tokens = router.tokenize(body, chat)
            assert tokens.send and tokens.ids
            took = best_ms(lambda b=body, c=chat: router.tokenize(b, c))
            inline = _median_stall(router, body, chat, True)
            as_run = _median_stall(router, body, chat, False)
            ids = json.dumps(tokens.ids, separators=(",", ":"))
            leg = {"model": "m", "prompt": text}
            with_ids = {**leg, "prompt_token_ids": tokens.ids}
            parse = (best_ms(lambda w=with_ids: CompletionRequest.model_validate(w))
                     - best_ms(lambda w=leg: CompletionRequest.model_validate(w)))
            print(f"{route:<12} {len(tokens.ids):>6}  {len(text):>6}  {took:>17.2f}  "
                  f"{inline:>21.2f}  {as_run:>21.2f}  {len(ids):>14}  {parse:>21.3f}")


if __name__ == "__main__":
    main()
