"""JSON schemas and a small validator for the structured-output tests (issue 31)."""

from __future__ import annotations

import re

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
