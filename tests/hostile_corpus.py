"""Hostile request bodies for the engines and the proxy, and a client that notices resets.

Every body in `corpus()` is invalid on the route it names, whatever server gets it: the
answer must be a 4xx naming what was wrong, on a connection the server keeps open. Bodies
are raw bytes, so text JSON cannot carry through `json.dumps` (a lone surrogate written as
UTF-8, invalid UTF-8) is in the corpus too.
"""

from __future__ import annotations

import http.client
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

SURROGATE = "\ud800"
MODEL = "m"  # pd_harness's --served-model-name
COMPLETIONS, CHAT, TOKENIZE, DETOKENIZE = ("/v1/completions", "/v1/chat/completions",
                                           "/tokenize", "/detokenize")
BASE = {
    COMPLETIONS: {"model": MODEL, "prompt": "hello", "max_tokens": 2},
    CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    TOKENIZE: {"prompt": "hello"},
    DETOKENIZE: {"tokens": [5, 6]},
}


@dataclass(frozen=True)
class Case:
    path: str
    body: bytes
    field: str  # the field made hostile, which the error must name ("": the whole body)

    def __repr__(self) -> str:
        return f"{self.path} {self.field or 'body'}: {self.body[:60]!r}"


def nested(depth: int, leaf: Any = 1) -> str:
    return "[" * depth + json.dumps(leaf) + "]" * depth


_TEXT = [SURROGATE, "ok \udfff", {"a": 1}, [{"a": 1}], 5, True]
_INT = [True, False, 2**64, -(2**64), 1.5, "x", [1], {"a": 1}, 10**400]
_FLOAT = [True, "x", [1.0], {"a": 1}, -1e308]  # -1e308 is out of every float field's range
_BOOL = ["maybe", [True], {"a": 1}, 2, SURROGATE]
_SAMPLING: dict[str, list[Any]] = {
    "model": _TEXT, "user": _TEXT, "n": _INT, "best_of": _INT, "top_k": _INT, "seed": _INT,
    "min_tokens": _INT, "max_tokens": _INT, "data_parallel_rank": _INT,
    "temperature": _FLOAT, "top_p": _FLOAT, "min_p": _FLOAT, "presence_penalty": _FLOAT,
    "frequency_penalty": _FLOAT, "repetition_penalty": _FLOAT,
    "ignore_eos": _BOOL, "include_stop_str_in_output": _BOOL, "skip_special_tokens": _BOOL,
    "stream": _BOOL,
    "stop": [SURROGATE, [SURROGATE], [1], {"a": 1}, 5, [""]],
    "stop_token_ids": [[True], [-1], [2**64], "x", [SURROGATE]],
    "stream_options": ["x", [1], {"include_usage": "maybe"}],
    "logit_bias": [{"1": "x"}, {"1": True}, {"1": 1.0}, [1]],
    "kv_transfer_params": ["x", [1], {"a": SURROGATE}, {SURROGATE: 1}],
}
_FIELDS: dict[str, dict[str, list[Any]]] = {
    COMPLETIONS: {
        **_SAMPLING, "logprobs": _INT, "echo": _BOOL, "suffix": ["tail", SURROGATE, 5],
        "prompt": [SURROGATE, "a" + SURROGATE, [SURROGATE], ["ok", "\udfff"], [True, False],
                   [[True]], [], "", [-1], [2**64], {"a": 1}, 5, [1.5], [[1, "a"]],
                   list(range(5, 1500)), "a " * 60_000],
    },
    CHAT: {
        **_SAMPLING, "max_completion_tokens": _INT, "top_logprobs": _INT,
        "logprobs": _BOOL, "add_generation_prompt": _BOOL, "continue_final_message": _BOOL,
        "tools": [[{"type": "function"}], "x"], "response_format": [{"type": "xml"}, 5],
        "messages": [
            [{"role": "user", "content": SURROGATE}],
            [{"role": "user", "content": [{"type": "text", "text": "a" + SURROGATE}]}],
            [{"role": SURROGATE, "content": "hi"}], [{"role": "robot", "content": "hi"}],
            [{"role": "user", "content": "hi", "name": SURROGATE}],
            [{"role": "user", "content": 5}], [{"role": "user", "content": [5]}],
            [{"role": "user", "content": [{"type": "image", "text": "x"}]}],
            "x", [], [5], [[{"role": "user", "content": "hi"}]], {"role": "user"},
        ],
    },
    TOKENIZE: {
        "prompt": [SURROGATE, 5, [1, 2], {"a": 1}],
        "messages": [[{"role": "user", "content": SURROGATE}], "x"],
        "add_special_tokens": _BOOL, "model": _TEXT,
    },
    DETOKENIZE: {
        "tokens": [[True], [-1], [2**40], [10**6], "x", [SURROGATE], None, [[1]]],
        "model": _TEXT,
    },
}


def _encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()  # lone surrogates become "\ud800" escapes


def corpus(paths: tuple[str, ...] = (COMPLETIONS, CHAT, TOKENIZE, DETOKENIZE)) -> list[Case]:
    """Wrong types, bad text and out-of-range values in every field of each route, then
    whole-body attacks (deep nesting, raw bytes no JSON encoder would write)."""
    cases = []
    for path in paths:
        base = BASE[path]
        for name, values in _FIELDS[path].items():
            cases += [Case(path, _encode({**base, name: v}), name) for v in values]
        if path in (TOKENIZE, DETOKENIZE):
            cases.append(Case(path, b'{"prompt": "a", "messages": []}' if path == TOKENIZE
                              else b"{}", ""))
        head = _encode(base)[:-1]
        bodies = [
            head + b', "extra": ' + nested(100).encode() + b"}",
            head + b', "extra": ' + nested(5_000).encode() + b"}",
            head + b', "extra": ' + nested(100_000).encode() + b"}",
            head + b', "extra": {"a": ' + nested(80, {"b": 1}).encode() + b"}}",
            head + b', "extra": "\xed\xa0\x80"}',  # a surrogate written as UTF-8
            head + b', "extra": "\xff\xfe"}',  # not UTF-8 at all
            head + b', "extra": ' + b"9" * 5000 + b"}",  # past Python's int digit limit
            head + b', "\xed\xa0\x80": 1}',  # a key that is not Unicode
            head, b"", b"[]", b"null", b'"\\ud800"', b"{" * 50_000,
        ]
        cases += [Case(path, body, "") for body in bodies]
        if path in (COMPLETIONS, CHAT):
            cases.append(Case(path, head + b', "temperature": 1e999, "max_tokens": NaN}', ""))
    return cases


class KeepAlive:
    """One HTTP/1.1 connection to a server, reused for every request: a server that drops
    it (resets after a 500, or closes) is seen, never papered over by a reconnect."""

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        self.conn.auto_open = 0  # never reconnect behind the test's back
        self.conn.connect()
        self.headers = {"Content-Type": "application/json", **(headers or {})}

    def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """(status, body). Raises AssertionError when the server dropped the connection."""
        sock = self.conn.sock
        try:
            self.conn.request("POST", path, body=body, headers=self.headers)
            resp = self.conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            raise AssertionError(f"connection dropped on POST {path}: {exc!r}") from exc
        assert not resp.will_close and self.conn.sock is sock, \
            f"POST {path} answered {resp.status} and closed the connection"
        return resp.status, data

    def close(self) -> None:
        self.conn.close()


def error_of(status: int, data: bytes) -> dict[str, Any]:
    """The OpenAI error object of a 4xx answer (asserts the shape)."""
    assert 400 <= status < 500, (status, data[:300])
    err = json.loads(data)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err
