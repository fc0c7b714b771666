"""Admission check of a parsed JSON request body, before any field is validated or used.

Two things no field validator can be trusted to handle, because they break code far from
the HTTP layer: text that is not valid Unicode (JSON's `"\\ud800"`, or UTF-8-encoded
surrogate bytes, parse to a Python str with a lone surrogate, which the tokenizer, the chat
template, msgspec and the JSON response encoder all refuse with exceptions of their own) and
nesting deep enough to exhaust Python's recursion limit in a validator, `repr` or an encoder.

The walk is iterative, so a body nested as deep as the JSON parser allowed is still judged
without recursing. Invariant: a body that passes holds only strings that encode to UTF-8 and
is at most `MAX_JSON_DEPTH` containers deep.
"""

from __future__ import annotations

import re
from typing import Any

MAX_JSON_DEPTH = 64  # the deepest legitimate body (chat content parts, kv params) is ~6

_MAX_PATH = 120  # a path names client keys: bounded, so an error message stays short
_SURROGATE = re.compile("[\ud800-\udfff]")
_SCALARS = {int, float, bool, type(None)}  # JSON values with nothing in them to judge


def body_problem(body: Any, max_depth: int = MAX_JSON_DEPTH) -> tuple[str, str] | None:
    """(field path such as "messages.0.content", what is wrong) for the first offending
    value of `body`, or None when the body is admissible."""
    stack: list[tuple[Any, str, int]] = [(body, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            hit = _SURROGATE.search(value)
            if hit is not None:
                return path or "body", (f"text is not valid Unicode: lone surrogate "
                                        f"U+{ord(hit.group()):04X} at index {hit.start()}")
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > max_depth:
            return path or "body", f"JSON nested deeper than {max_depth} levels"
        if isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str) and _SURROGATE.search(key) is not None:
                    return path or "body", "a key is not valid Unicode (lone surrogate)"
                stack.append((item, _join(path, key), depth + 1))
        elif not set(map(type, value)) <= _SCALARS:  # token ids: judged in C, no walk
            stack.extend((item, _join(path, i), depth + 1) for i, item in enumerate(value))
    return None


def _join(path: str, key: Any) -> str:
    joined = f"{path}.{key}" if path else str(key)
    return joined if len(joined) <= _MAX_PATH else joined[:_MAX_PATH] + "..."


def first_field(path: str) -> str:
    """The top-level field of a path ("messages.0.content" -> "messages")."""
    return path.split(".", 1)[0]
