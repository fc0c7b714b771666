"""The proxy's tokenize-once (proxy/routing.py Router.tokenize / prompt_tokens): the ids it
sends are the engine's own for the request, on the event loop or on the proxy-tokenize thread
(encode_batch, which releases the GIL), and it sends none it did not make itself."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engine.frontend.input_processor import tokenizer_fingerprint
from engine.models.formats import load_tokenizer
from engine.server.chat import request_prompt
from engine.server.openai_protocol import ChatCompletionRequest
from engine.server.tools import tool_plan
from proxy.routing import NO_TOKENS, THREAD_MIN_CHARS, Router

TOOL = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"town": {"type": "string"}}}}}
CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "hi é 日本"}]},
    {"messages": [{"role": "system", "content": "brief"},
                  {"role": "user", "content": [{"type": "text", "text": "a"},
                                               {"type": "text", "text": "b"}]}],
     "add_generation_prompt": False},
    {"messages": [{"role": "user", "content": "tell"}, {"role": "assistant", "content": "Once"}],
     "add_generation_prompt": False, "continue_final_message": True},
    {"messages": [{"role": "user", "content": "weather?"}], "tools": [TOOL],
     "tool_choice": "required"},
]


@pytest.fixture(scope="module")
def router(tiny_model: str) -> Router:
    return Router(None, None, None, None, None, load_tokenizer(tiny_model))  # type: ignore[arg-type]


def _engine_ids(tokenizer: Any, raw: dict[str, Any]) -> list[int]:
    """What the chat route renders (engine/server/chat.py, a server without a tool parser)."""
    body = ChatCompletionRequest.model_validate(raw)
    plan = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls, None)
    return request_prompt(tokenizer, body, plan)["prompt_token_ids"]


@pytest.mark.parametrize("raw", CHATS)
def test_chat_ids_are_the_engine_route_s_own(router: Router, raw: dict[str, Any]) -> None:
    tokens = router.tokenize({"model": "m", **raw}, True)
    assert tokens.send and tokens.ids == _engine_ids(router.tokenizer, raw)


def test_long_prompts_go_to_the_thread_with_the_same_ids(router: Router) -> None:
    text = "the prefill engine writes é 日本 into the decode engine\n" * (THREAD_MIN_CHARS // 40)
    for body, chat in (({"prompt": text}, False),
                       ({"messages": [{"role": "user", "content": text}]}, True)):
        inline = router.tokenize(body, chat)
        assert router._pool is None or chat  # the first long prompt makes the pool
        threaded = asyncio.run(router.prompt_tokens(body, chat))
        assert router._pool is not None
        assert threaded == inline and inline.send and len(inline.ids or []) > 1000
    short = {"prompt": "short"}
    assert asyncio.run(router.prompt_tokens(short, False)) == router.tokenize(short, False)
    assert router.tokenize(short, False).ids == router.tokenizer.encode("short")


def test_the_ids_go_with_the_tokenizer_s_fingerprint(router: Router, tiny_model: str,
                                                     tmp_path) -> None:
    from tokenize_once_kit import foreign_tokenizer

    legs = router.tokenize({"prompt": "hello"}, False).for_legs
    assert legs == {"prompt_token_ids": router.tokenizer.encode("hello"),
                    "prompt_tokenizer": tokenizer_fingerprint(load_tokenizer(tiny_model))}
    other = load_tokenizer(foreign_tokenizer(tiny_model, str(tmp_path)))
    assert len(other) == len(router.tokenizer)
    assert tokenizer_fingerprint(other) != legs["prompt_tokenizer"]


def test_ids_the_proxy_did_not_make_are_not_sent(router: Router) -> None:
    # the client's own ids route but stay in its body (the engines check them)
    given = router.tokenize({"prompt": "x", "prompt_token_ids": [5, 6]}, False)
    assert given.ids == [5, 6] and given.for_legs is None
    assert router.tokenize({"prompt": [5, 6, 7]}, False).for_legs is None
    # a body the engine refuses: no ids, the engine answers it
    for body, chat in (({"prompt": "x", "prompt_token_ids": "bad"}, False),
                       ({"prompt": ""}, False), ({"prompt": ["a", "b"]}, False),
                       ({"messages": [{"role": "wizard", "content": "x"}]}, True),
                       ({"messages": [{"role": "user", "content": "x"}],
                         "tool_choice": "required"}, True)):
        assert router.tokenize(body, chat) == NO_TOKENS, body
    assert Router(None, None, None, None, None).tokenize(  # type: ignore[arg-type]
        {"prompt": "x"}, False) == NO_TOKENS
