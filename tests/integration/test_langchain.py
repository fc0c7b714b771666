"""LangChain's ChatOpenAI against one colocated server of the tiny random model (issue 31):
the agent-framework calls that used to fail on the first request (`400 tools are not
supported`, `400 only response_format type 'text' is supported`) now work, and the grammar,
not the random model, makes what LangChain parses valid: bind_tools with tool_choice
required / a named tool (streamed and not), with_structured_output in its default method
(json_schema), function_calling and json_mode, and a history with a tool call and its result.
LangChain touches no network but the server's loopback socket (tiktoken is never loaded)."""

from __future__ import annotations

import ipaddress
import os
import sys
from collections.abc import Iterator
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field
from structured_kit import TIME, TOOLS, WEATHER, tool_server, validates

from pdserve.launcher import ServerProcess

langchain_openai = pytest.importorskip("langchain_openai")
from langchain_core.messages import (  # noqa: E402 - after the importorskip
    AIMessage,
    HumanMessage,
    ToolMessage,
)

_HOSTS: list[str] = []  # every host a socket of this process resolved or connected to
_WATCH = [False]  # while this module's tests run (an audit hook stays for the session)


def _audit(event: str, args: tuple) -> None:
    if not _WATCH[0]:
        return
    if event == "socket.getaddrinfo":
        _HOSTS.append(str(args[0]))
    elif event == "socket.connect" and isinstance(args[1], tuple):
        _HOSTS.append(str(args[1][0]))


sys.addaudithook(_audit)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class Person(BaseModel):
    name: str = Field(pattern="^[a-z]{1,6}$")
    role: Literal["admin", "user", "guest"]
    active: bool
    tags: list[Literal["x", "y"]] = Field(max_length=3)


class Anything(BaseModel):  # json_mode promises an object, not a schema
    model_config = ConfigDict(extra="allow")


@pytest.fixture(scope="module")
def server(tiny_model: str) -> Iterator[ServerProcess]:
    yield from tool_server(tiny_model)


@pytest.fixture(scope="module")
def chat(server: ServerProcess):
    for var in ("LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2", "OPENAI_BASE_URL"):
        os.environ.pop(var, None)
    model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]

    def make(seed: int = 0, max_tokens: int = 200):
        return langchain_openai.ChatOpenAI(
            model=model, base_url=server.url + "/v1", api_key="x", temperature=1.0,
            seed=seed, max_tokens=max_tokens, max_retries=0, timeout=120)

    _HOSTS.clear()
    _WATCH[0] = True
    yield make
    _WATCH[0] = False
    assert _HOSTS and all(_loopback(h) for h in _HOSTS), _HOSTS


def _valid(call: dict) -> bool:
    schema = {"get_weather": WEATHER, "get_time": TIME}.get(call["name"])
    return schema is not None and validates(call["args"], schema)


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_bind_tools_returns_valid_tool_calls_streamed_and_not(chat, choice) -> None:
    for seed in range(2):
        llm = chat(seed).bind_tools(TOOLS, tool_choice=choice, parallel_tool_calls=False)
        whole = llm.invoke("weather in paris?")
        assert isinstance(whole, AIMessage) and len(whole.tool_calls) == 1, whole
        call = whole.tool_calls[0]
        assert _valid(call), call
        assert choice == "required" or call["name"] == "get_weather"
        merged = None
        chunks = 0
        for chunk in llm.stream("weather in paris?"):
            merged = chunk if merged is None else merged + chunk
            chunks += 1
        assert chunks > 2 and merged is not None
        assert [(c["name"], c["args"]) for c in merged.tool_calls] == [
            (call["name"], call["args"])], (merged.tool_calls, whole.tool_calls)


@pytest.mark.parametrize("method", [None, "function_calling", "json_mode"])
def test_with_structured_output_returns_a_valid_object(chat, method) -> None:
    schema = Anything if method == "json_mode" else Person
    kw = {} if method is None else {"method": method}
    for seed in range(2):
        llm = chat(seed).with_structured_output(schema, include_raw=True, **kw)
        out = llm.invoke("describe a person")
        assert out["parsing_error"] is None, out
        assert isinstance(out["parsed"], schema), out
        raw = out["raw"]
        # the default (json_schema) and json_mode answer in content, function_calling in a call
        assert bool(raw.tool_calls) == (method == "function_calling"), raw
        assert raw.response_metadata.get("finish_reason") == "stop", raw


def test_a_tool_call_and_its_result_in_the_history_are_answered(chat) -> None:
    question = HumanMessage("weather in paris?")
    history = [question,
               AIMessage(content="", tool_calls=[{"name": "get_weather", "id": "call_1",
                                                  "args": {"city": "paris", "unit": "c"}}]),
               ToolMessage("sunny, 21 C", tool_call_id="call_1")]
    llm = chat(max_tokens=4).bind_tools(TOOLS, tool_choice="none")
    short = llm.invoke([question])
    full = llm.invoke(history)
    assert isinstance(full, AIMessage) and full.content, full
    assert full.usage_metadata["input_tokens"] > short.usage_metadata["input_tokens"] + 10


@pytest.mark.parametrize("choice", ["required",
                                    {"type": "function", "function": {"name": "get_weather"}}])
def test_openai_stream_sends_arguments_in_fragments_as_generated(server, chat, choice) -> None:
    """OpenAI's streaming shape with the openai client: the call's first delta has its id,
    type and name with arguments "", then more than one chunk carries argument fragments, joined
    character for character the unstreamed answer's arguments. get_weather alone is offered:
    with get_time too, tool_choice required may sample get_time (it did on CI's CPU), whose
    arguments ({"zone": "cet"}) the grammar grows in three steps, and a client that lags gets
    steps merged into one chunk."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    kw = {"model": client.models.list().data[0].id, "max_tokens": 200, "temperature": 1.0,
          "seed": 3, "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS[:1],
          "tool_choice": choice, "parallel_tool_calls": False}
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0].function
    first, fragments = None, []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if first is None:
                first = d
            elif d.function.arguments:
                fragments.append(d.function.arguments)
    assert first.id and first.type == "function" and first.function.name == whole.name
    assert first.function.arguments == "" and len(fragments) > 1, fragments
    assert "".join(fragments) == whole.arguments
