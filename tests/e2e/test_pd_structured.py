"""Structured output through push and pull P/D (issue 31 item 3): the proxy sends P the same grammar
fields, so P's first token obeys the grammar, and D's matcher continues from that token (D is
seeded with it: kv_first_token_seeded_total rises). Every answer equals D colocated token for
token, streamed and not, greedy and seeded, and validates."""

from __future__ import annotations

import json

import pytest
from first_token_kit import SEEDED, check_equal, post
from pd_harness import deployment, metric
from structured_kit import PERSON, TOOLS, valid_call, validates
from tokenize_once_kit import tokenizations


@pytest.fixture(scope="module")
def pd(tiny_model: str):
    # the proxy tokenizes once (tests/tokenize_once_kit.py): grammars and tools unchanged
    with deployment(tiny_model, "push", proxy_args=("--tokenizer", tiny_model)) as dep:
        yield dep


CHAT_JSON = {"messages": [{"role": "user", "content": "a person"}], "logprobs": True,
             "response_format": {"type": "json_schema", "json_schema": {
                 "name": "p", "schema": PERSON, "strict": True}}}
SEEDED_SAMPLING = {"temperature": 0.9, "seed": 5}
CASES = [  # (path, fields, streamed)
    ("/v1/completions", {"prompt": "a person:", "guided_json": PERSON, "logprobs": 1,
                         **SEEDED_SAMPLING}, False),
    ("/v1/completions", {"prompt": "one person:", "guided_json": PERSON, "logprobs": 1,
                         **SEEDED_SAMPLING}, True),
    ("/v1/chat/completions", {**CHAT_JSON, "temperature": 0.0}, False),
    ("/v1/chat/completions", {**CHAT_JSON, **SEEDED_SAMPLING}, True),
    ("/v1/completions", {"prompt": "a colour:", "guided_choice": ["red", "green", "blue"],
                         **SEEDED_SAMPLING}, False),
]


@pytest.mark.parametrize("case", [0, 3, 4])  # the pull module below runs 1 and 2
def test_constrained_pd_answer_equals_colocated_and_obeys_the_grammar(pd, case: int) -> None:
    path, fields, streamed = CASES[case]
    body = {"model": "m", "max_tokens": 120, **fields}
    check_equal(pd, path, body, streamed)
    answer = post(pd.proxy.url, path, body)["choices"][0]
    text = answer.get("text", answer.get("message", {}).get("content"))
    if "guided_choice" in fields:
        assert text in fields["guided_choice"], text
    else:
        assert validates(json.loads(text), PERSON), text


def test_required_tool_call_through_pd_equals_colocated(pd) -> None:
    body = {"model": "m", "max_tokens": 120, "temperature": 0.9, "seed": 3, "tools": TOOLS,
            "tool_choice": "required", "parallel_tool_calls": False,
            "messages": [{"role": "user", "content": "weather in town?"}]}

    def calls(answer: dict) -> list[tuple[str, str]]:
        msg = answer["choices"][0]["message"]
        return [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]]

    colocated = calls(post(pd.d.url, "/v1/chat/completions", body))
    seeded, counts = metric(pd.d, SEEDED), tokenizations(pd.d)
    via = calls(post(pd.proxy.url, "/v1/chat/completions", body))
    assert via == colocated and len(via) == 1 and valid_call(*via[0]), (via, colocated)
    assert metric(pd.d, SEEDED) == seeded + 1
    # D took the prompt the proxy rendered with the tools (the engine's own template path)
    assert tokenizations(pd.d) == {**counts, "given": counts["given"] + 1}


@pytest.fixture(scope="module")
def pd_pull(tiny_model: str):
    with deployment(tiny_model, "pull") as dep:
        yield dep


@pytest.mark.parametrize("case", [1, 2])  # completions json streamed, chat json_schema
def test_constrained_pull_answer_equals_colocated(pd_pull, case: int) -> None:
    path, fields, streamed = CASES[case]
    check_equal(pd_pull, path, {"model": "m", "max_tokens": 120, **fields}, streamed)
