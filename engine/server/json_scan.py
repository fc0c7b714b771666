"""Spans in JSON text that may still be growing (a streamed answer, issue 31): where a value
ends, an object's members, an array's elements. Lenient by design: it finds where things
are; json.loads decides whether the finished text is JSON."""

from __future__ import annotations

import json
import re

_WS = " \t\n\r"
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*("|\\?\Z)|[{}\[\]]', re.S)


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


Memo = dict[int, tuple[int, int | None]]


def value_end(s: str, i: int, memo: Memo | None = None) -> int | None:
    """End (exclusive) of the JSON value starting at s[i]; None while the text ends inside it
    (a number at the very end may still grow). `memo`, kept by a caller whose text only
    grows, resumes an object's scan where the last call stopped (linear, not quadratic, in a
    streamed answer)."""
    if i >= len(s):
        return None
    if s[i] == '"':
        m = _STRING.match(s, i)
        return m.end() if m else None
    if s[i] in "{[":
        pos, depth = (i, 0) if memo is None else memo.get(i, (i, 0))
        if depth is None:
            return pos  # ended before
        for m in _TOKEN.finditer(s, pos):  # whole strings and brackets, scanned in C
            tok = m.group()
            if tok[0] == '"':
                if m.group(1) != '"':  # the text ends inside a string
                    pos = m.start()
                    break
            elif tok in "{[":
                depth += 1
            else:
                depth -= 1
                if depth == 0:
                    if memo is not None:
                        memo[i] = (m.end(), None)
                    return m.end()
        else:
            pos = len(s)
        if memo is not None:
            memo[i] = (pos, depth)
        return None
    j = i
    while j < len(s) and s[j] not in _WS + ",}]":
        j += 1
    return j if j < len(s) else None


def members(s: str, i: int, memo: Memo | None = None) -> dict[str, tuple[int, int | None]]:
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
        end = value_end(s, start, memo)
        out[key] = (start, end)
        if end is None:
            return out
        j = skip_ws(s, end)
    return out


def elements(s: str, i: int, memo: Memo | None = None) -> list[int]:
    """Where the elements of the array at s[i] == '[' begin, as far as the text goes."""
    starts: list[int] = []
    j = skip_ws(s, i + 1)
    while j < len(s) and s[j] != "]":
        starts.append(j)
        end = value_end(s, j, memo)
        if end is None:
            break
        j = skip_ws(s, end)
        if j < len(s) and s[j] == ",":
            j = skip_ws(s, j + 1)
        elif j < len(s) and s[j] != "]":
            break
    return starts
