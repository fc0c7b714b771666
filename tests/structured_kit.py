"""JSON schemas and a small validator for the structured-output tests (issue 31)."""

from __future__ import annotations

import re
from collections.abc import Iterator

from pd_harness import TEST_ENV

from pdserve.launcher import ServerProcess, launch_server

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {"zip": {"type": "string",
                    "pattern": "^[0-9]{5}$"}}, "required": ["zip"],
                    "additionalProperties": False},
    },
    "required": ["name", "role", "active", "tags", "address"],
    "additionalProperties": False,
}


def validates(value: object, schema: dict) -> bool:
    """The subset of JSON Schema PERSON uses (jsonschema is not a dependency)."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "string":
        return isinstance(value, str) and re.fullmatch(schema["pattern"], value) is not None
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "array":
        return (isinstance(value, list) and len(value) <= schema.get("maxItems", 1 << 30)
                and all(validates(v, schema["items"]) for v in value))
    props = schema["properties"]
    return (isinstance(value, dict) and set(schema["required"]) <= value.keys() <= props.keys()
            and all(validates(v, props[k]) for k, v in value.items()))


WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
    "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
    "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]


def valid_call(name: str, arguments: str) -> bool:
    import json

    schema = {"get_weather": WEATHER, "get_time": TIME}.get(name)
    return schema is not None and validates(json.loads(arguments), schema)


def assemble_tool_calls(stream) -> tuple[list[tuple[str, str]], str | None]:
    """An openai-client stream's tool_calls deltas put together as OpenAI's docs do:
    by index, the name from the first delta, arguments concatenated."""
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                entry = calls.setdefault(d.index, ["", ""])
                if d.function and d.function.name:
                    entry[0] = d.function.name
                if d.function and d.function.arguments:
                    entry[1] += d.function.arguments
    return [(n, a) for _, (n, a) in sorted(calls.items())], finish


def tool_server(model: str) -> Iterator[ServerProcess]:
    """A colocated server of `model` with tool calls on: the tiny model's chat template is
    ChatML (Qwen's), so its parser is hermes. For a module fixture: `yield from`."""
    s = launch_server(model, "--dtype", "float32", "--max-model-len", "512",
                      "--num-kv-blocks", "64", "--log-level", "warning",
                      "--enable-auto-tool-choice", "--tool-call-parser", "hermes", env=TEST_ENV)
    yield s
    s.stop()
