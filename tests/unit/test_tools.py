"""Tool calling without a server (issue 31): the Hermes and Llama 3 JSON parsers read calls
out of an answer (text that is not a call stays content), a streamed answer split anywhere
assembles to the same calls with the content before them streamed, and what cannot be
served is refused naming the flag or field."""

from __future__ import annotations

import json

import pytest

from engine.server.errors import APIError
from engine.server.tools import ToolStream, answer, tool_plan
from engine.server.vllm_flags import tool_call_parser

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "g"}}]
HERMES = ('Let me check.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
          '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')
LLAMA = '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}'


def _calls(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("parser, text", [("hermes", HERMES), ("llama3_json", LLAMA)])
def test_parsers_read_the_calls(parser: str, text: str) -> None:
    plan = tool_plan(TOOLS, "auto", None, parser)
    content, calls, finish = answer(plan, text, "stop")
    assert _calls(calls) == [("f", {"a": 1}), ("g", {})] and finish == "tool_calls"
    assert content == ("Let me check." if parser == "hermes" else None)
    plain, none, finish = answer(plan, "just words {", "stop")
    assert (plain, none, finish) == ("just words {", None, "stop")


@pytest.mark.parametrize("parser, text", [("hermes", HERMES), ("llama3_json", LLAMA)])
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_deltas_assemble_to_the_same_calls(parser: str, text: str, step: int) -> None:
    plan = tool_plan(TOOLS, "auto", True, parser)
    stream = ToolStream(plan)
    deltas, finish = [], None
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for j, piece in enumerate(pieces):
        out, finish = stream.deltas(0, piece, "stop" if j == len(pieces) - 1 else None)
        deltas += out
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            entry = calls.setdefault(c["index"], ["", ""])
            entry[0] = c["function"].get("name") or entry[0]
            entry[1] += c["function"].get("arguments", "")
    assert [(n, json.loads(a)) for n, a in calls.values()] == [("f", {"a": 1}), ("g", {})]
    assert content.strip() == ("Let me check." if parser == "hermes" else "")
    assert finish == "tool_calls"


def test_required_and_named_grammars() -> None:
    required = json.loads(tool_plan(TOOLS, "required", False, None).structured.spec)
    assert required["maxItems"] == 1 and len(required["items"]["anyOf"]) == 2
    named = tool_plan(TOOLS, {"type": "function", "function": {"name": "g"}}, None, None)
    assert json.loads(named.structured.spec) == {"type": "object"}
    assert answer(named, '{"x": 2}', "stop")[1][0]["function"]["arguments"] == '{"x": 2}'


@pytest.mark.parametrize("tools, choice, named", [
    (TOOLS, "auto", "--tool-call-parser"),
    (TOOLS, None, "--tool-call-parser"),  # OpenAI's default with tools is auto
    (TOOLS, {"type": "function", "function": {"name": "h"}}, "'h'"),
    (TOOLS, "sometimes", "tool_choice must be"),
    (TOOLS + TOOLS[:1], "required", "distinct"),
    (None, "required", "tool_choice needs tools"),
])
def test_what_cannot_be_served_is_refused_naming_it(tools, choice, named) -> None:
    with pytest.raises(APIError, match=named):
        tool_plan(tools, choice, None, None)


def test_only_the_parsers_we_implement_are_accepted() -> None:
    assert tool_call_parser(True, "hermes") == "hermes"
    assert tool_call_parser(False, "hermes") is None
    with pytest.raises(ValueError, match="--tool-call-parser mistral is not supported"):
        tool_call_parser(True, "mistral")
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        tool_call_parser(True, None)


def _stream(plan, text: str, step: int, finish: str = "stop"):
    stream = ToolStream(plan)
    deltas, pieces = [], [text[i:i + step] for i in range(0, len(text), step)]
    for j, piece in enumerate(pieces):
        out, _ = stream.deltas(0, piece, finish if j == len(pieces) - 1 else None)
        deltas.append(out)
    return deltas


REQUIRED = '[{"name": "f", "parameters": {"q": "a \\"}]\\" b", "n": [1, {"m": 2}]}}]'
NAMED = '{"x": {"y": [1, 2, "}"]}, "z": true}'


@pytest.mark.parametrize("choice, parser, text", [
    ("auto", "hermes", HERMES.replace('{"a": 1}', '{"a": 1, "b": "x}y", "c": [1, 2]}')),
    ("auto", "llama3_json", LLAMA.replace('{"a": 1}', '{"a": 1, "b": "x}y", "c": [1, 2]}')),
    ("required", None, REQUIRED),
    ({"type": "function", "function": {"name": "g"}}, None, NAMED),
])
@pytest.mark.parametrize("step", [1, 4])
def test_tool_call_arguments_stream_as_they_are_generated(choice, parser, text, step) -> None:
    """OpenAI's shape: per call a first delta with index, id, type, name and arguments "",
    then argument fragments while the JSON grows; joined, they equal the unstreamed answer's
    arguments character for character. (The old code sent each call's arguments whole in one
    delta after the last token.)"""
    plan = tool_plan(TOOLS, choice, True, parser)
    _, whole, finish = answer(plan, text, "stop")
    steps = _stream(plan, text, step)
    calls: dict[int, list] = {}
    for n, out in enumerate(steps):
        for d in out:
            for c in d.get("tool_calls", []):
                if c["index"] not in calls:
                    assert c["id"].startswith("call_") and c["type"] == "function"
                    assert c["function"]["arguments"] == ""
                    calls[c["index"]] = [c["function"]["name"], "", []]
                elif c["function"].get("arguments"):
                    calls[c["index"]][1] += c["function"]["arguments"]
                    calls[c["index"]][2].append(n)
    assert [(n, a) for n, a, _ in calls.values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole]
    first_call_steps = next(iter(calls.values()))[2]
    assert len(set(first_call_steps)) > 3  # fragments from several steps, not one at the end
    assert first_call_steps[0] < len(steps) - 1


def test_a_call_cut_short_stays_as_streamed_and_plain_text_stays_content() -> None:
    plan = tool_plan(TOOLS, "required", True, None)
    steps = _stream(plan, REQUIRED[:40], 1, finish="length")
    frags = [c["function"].get("arguments", "") for out in steps for d in out
             for c in d.get("tool_calls", [])]
    assert "".join(frags) == REQUIRED[REQUIRED.index('{"q"'):40]
    hermes = tool_plan(TOOLS, "auto", True, "hermes")
    text = "no call <tool_cal here"
    content = "".join(d.get("content", "") for out in _stream(hermes, text, 1) for d in out)
    assert content == text


@pytest.mark.parametrize("value", [
    {"a": "x}]\"{[", "b": [1, {"c": "\\\\"}], "d": "\\u00e9\\\"", "e": -1.5e3, "f": None},
    ["a\\\\", "\"", [], {}], "plain \\\" string", 12.5, True])
def test_json_scan_finds_the_end_of_a_value_and_no_end_in_any_prefix(value) -> None:
    from engine.server.json_scan import value_end

    text = json.dumps(value) + " ,"
    end = len(text) - 2
    assert value_end(text, 0) == end
    assert all(value_end(text[:k], 0) is None for k in range(end if text[0] in "{[\"" else 1))
    memo: dict = {}  # a growing text, scanned where the last call stopped
    assert [value_end(text[:k], 0, memo) for k in range(1, len(text) + 1)] == [
        None if k < end or (k == end and text[0] not in "{[\"") else end
        for k in range(1, len(text) + 1)]
