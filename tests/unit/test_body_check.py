"""body_check: the whole-body admission check the engines and the proxy run before any field."""

from __future__ import annotations

import json

from engine.server.body_check import MAX_JSON_DEPTH, body_problem


def _deep(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


def test_an_honest_body_passes() -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "héllo 🙂"}]}],
            "kv_transfer_params": {"remote_block_ids": [1, 2], "x": {"y": None}}}
    assert body_problem(body) is None


def test_a_lone_surrogate_is_named_by_its_path() -> None:
    body = json.loads('{"messages": [{"role": "user", "content": "ok \\udc00"}]}')
    assert body_problem(body) == (
        "messages.0.content", "text is not valid Unicode: lone surrogate U+DC00 at index 3")
    assert body_problem({"prompt": ["a", "\ud800"]})[0] == "prompt.1"
    assert body_problem({"kv": {"\udfff": 1}}) == (
        "kv", "a key is not valid Unicode (lone surrogate)")
    assert body_problem("\ud800")[0] == "body"


def test_nesting_is_bounded_without_recursion() -> None:
    assert body_problem({"a": _deep(MAX_JSON_DEPTH - 2)}) is None
    path, what = body_problem({"a": _deep(MAX_JSON_DEPTH)})
    assert path.startswith("a.0.0") and "deeper than 64" in what
    # far past Python's recursion limit: judged all the same
    path, _ = body_problem({"a": _deep(100_000)})
    assert len(path) <= 123  # a path names client keys: bounded


def test_a_token_id_prompt_is_judged_without_a_walk_per_token() -> None:
    """A list of numbers has nothing to judge: the check must not build a path per element
    (it did: ~0.5 ms of the proxy's hop, and of each engine's admission, per 1k-token prompt).
    Measured as memory, which is exact where time is not: the per-element walk held a tuple
    and a path string for every token at once."""
    import tracemalloc

    body = {"prompt": list(range(200_000)), "logit_bias": {"5": 1.5}, "stop": None,
            "scores": [0.5, True, None, 3]}
    tracemalloc.start()
    try:
        assert body_problem(body) is None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, f"{peak} bytes to judge a prompt of token ids"
    # a list that holds anything else is still walked, element by element
    assert body_problem({"prompt": [1, 2, "\ud800"]})[0] == "prompt.2"
    assert body_problem({"prompt": [[1, 2], [3, "\udc00"]]})[0] == "prompt.1.1"
