"""The API's structured-output fields -> one StructuredOutput (or None), checked here.

Accepted spellings: OpenAI's response_format (json_object, json_schema), vLLM's guided_json /
guided_regex / guided_choice / guided_grammar and its structured_outputs object (json, regex,
choice, grammar, json_object). Two at once is a 400: which one wins would be a guess.
Light on purpose (the API server imports no torch): the grammar itself is compiled by the
engine core, which refuses one xgrammar cannot compile.
"""

from __future__ import annotations

import json
import re
from typing import Any

from engine.protocol import StructuredOutput

_SO_KEYS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar",
            "json_object": "json_object"}


def _bad(field: str, what: str) -> ValueError:
    return ValueError(f"{field} {what}")


def _schema(field: str, value: Any) -> StructuredOutput:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise _bad(field, f"is not valid JSON: {exc}") from exc
    if not isinstance(value, (dict, bool)):
        raise _bad(field, "must be a JSON schema (an object)")
    return StructuredOutput("json", json.dumps(value, sort_keys=True))


def _regex(field: str, value: Any) -> StructuredOutput:
    if not isinstance(value, str) or not value:
        raise _bad(field, "must be a non-empty regular expression")
    try:
        re.compile(value)
    except re.error as exc:
        raise _bad(field, f"is not a valid regular expression: {exc}") from exc
    return StructuredOutput("regex", value)


def _choice(field: str, value: Any) -> StructuredOutput:
    if (not isinstance(value, list) or not value
            or not all(isinstance(c, str) and c for c in value)):
        raise _bad(field, "must be a non-empty list of non-empty strings")
    return StructuredOutput("choice", json.dumps(value))


def _grammar(field: str, value: Any) -> StructuredOutput:
    if not isinstance(value, str) or not value.strip():
        raise _bad(field, "must be a non-empty EBNF grammar")
    return StructuredOutput("grammar", value)


_BUILD = {"json": _schema, "regex": _regex, "choice": _choice, "grammar": _grammar}


def _response_format(value: dict[str, Any]) -> StructuredOutput | None:
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise _bad("response_format.json_schema", "must be an object with a schema")
        return _schema("response_format.json_schema.schema", spec["schema"])
    raise _bad("response_format.type", f"must be text, json_object or json_schema, got {kind!r}")


def _structured_outputs(value: dict[str, Any]) -> StructuredOutput | None:
    unknown = sorted(k for k, v in value.items() if v not in (None, False)
                     and k not in _SO_KEYS)
    if unknown:
        raise _bad(f"structured_outputs.{unknown[0]}", "is not supported")
    given = [k for k in _SO_KEYS if value.get(k) not in (None, False)]
    if len(given) > 1:
        raise _bad("structured_outputs", f"sets {' and '.join(given)}: give one")
    if not given:
        return None
    if given[0] == "json_object":
        return StructuredOutput("json_object")
    return _BUILD[given[0]](f"structured_outputs.{given[0]}", value[given[0]])


def structured_output(
    *, response_format: dict[str, Any] | None = None,
    structured_outputs: dict[str, Any] | None = None, guided_json: Any = None,
    guided_regex: Any = None, guided_choice: Any = None, guided_grammar: Any = None,
) -> StructuredOutput | None:
    """The one grammar a request asks for (None: free text). ValueError names the field."""
    found: list[tuple[str, StructuredOutput]] = []
    if response_format:
        out = _response_format(response_format)
        if out is not None:
            found.append(("response_format", out))
    if structured_outputs:
        out = _structured_outputs(structured_outputs)
        if out is not None:
            found.append(("structured_outputs", out))
    guided = {"guided_json": (_schema, guided_json), "guided_regex": (_regex, guided_regex),
              "guided_choice": (_choice, guided_choice),
              "guided_grammar": (_grammar, guided_grammar)}
    for name, (build, value) in guided.items():
        if value is not None:
            found.append((name, build(name, value)))
    if len(found) > 1:
        raise _bad(found[1][0], f"conflicts with {found[0][0]}: give one structured output")
    return found[0][1] if found else None
