"""Spans in JSON text that may still be growing (a streamed answer, issue 31): where a value
ends, an object's members, an array's elements. Lenient by design: it finds where things
are; json.loads decides whether the finished text is JSON."""

from __future__ import annotations

import json

_WS = " \t\n\r"


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def value_end(s: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at s[i]; None while the text ends inside it
    (a number at the very end may still grow)."""
    if i >= len(s):
        return None
    if s[i] == '"':
        j = i + 1
        while j < len(s):
            if s[j] == "\\":
                j += 2
                continue
            if s[j] == '"':
                return j + 1
            j += 1
        return None
    if s[i] in "{[":
        depth, j, in_str = 0, i, False
        while j < len(s):
            ch = s[j]
            if in_str:
                if ch == "\\":
                    j += 1
                elif ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(s) and s[j] not in _WS + ",}]":
        j += 1
    return j if j < len(s) else None


def members(s: str, i: int) -> dict[str, tuple[int, int | None]]:
    """The members of the object at s[i] == '{' as far as the text goes: key -> (the value's
    start, its end or None while it grows). Stops at the first thing that is not JSON."""
    out: dict[str, tuple[int, int | None]] = {}
    j = skip_ws(s, i + 1)
    while j < len(s) and s[j] != "}":
        if s[j] == ",":
            j = skip_ws(s, j + 1)
            continue
        key_end = value_end(s, j) if s[j] == '"' else None
        if key_end is None:
            return out
        try:
            key = json.loads(s[j:key_end])
        except ValueError:
            return out
        j = skip_ws(s, key_end)
        if j >= len(s) or s[j] != ":":
            return out
        start = skip_ws(s, j + 1)
        if start >= len(s):
            return out
        end = value_end(s, start)
        out[key] = (start, end)
        if end is None:
            return out
        j = skip_ws(s, end)
    return out


def elements(s: str, i: int) -> list[int]:
    """Where the elements of the array at s[i] == '[' begin, as far as the text goes."""
    starts: list[int] = []
    j = skip_ws(s, i + 1)
    while j < len(s) and s[j] != "]":
        starts.append(j)
        end = value_end(s, j)
        if end is None:
            break
        j = skip_ws(s, end)
        if j < len(s) and s[j] == ",":
            j = skip_ws(s, j + 1)
        elif j < len(s) and s[j] != "]":
            break
    return starts
