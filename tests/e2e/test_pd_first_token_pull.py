"""Pull mode, issue 28: P's answer carries its sampled token (`first_token_ids`, and
`first_token_logprobs` when asked) and D starts from it; output equals colocated."""

from __future__ import annotations

import pytest
from first_token_kit import (
    RECOMPUTED,
    SEEDED,
    check_all_equal,
    check_n_recomputes,
    check_stop_on_first_token,
    completion_body,
    post,
)
from handover_kit import (
    check_first_token_before_decode,
    check_stream_stop_on_first_token,
    check_streams_exact,
)
from pd_harness import deployment, metric
from tokenize_once_kit import (
    check_foreign_tokenizer_is_not_trusted,
    check_tokenized_once,
    foreign_tokenizer,
)


@pytest.fixture(scope="module")
def pd(tiny_model: str):
    # the proxy tokenizes once for both legs (tests/tokenize_once_kit.py)
    with deployment(tiny_model, "pull", proxy_args=("--tokenizer", tiny_model)) as dep:
        yield dep


def test_pull_seeded_handover_equals_colocated(pd):
    check_all_equal(pd)


def test_pull_stop_on_first_token_leaves_no_block(pd):
    check_stop_on_first_token(pd)


def test_pull_n_above_one_recomputes(pd):
    check_n_recomputes(pd)


def test_pull_stream_is_colocated_with_p_token_first(pd):
    check_streams_exact(pd)


def test_pull_streamed_stop_on_first_token_is_p_alone(pd):
    check_stream_stop_on_first_token(pd)


def test_pull_client_has_token_1_while_d_is_stopped(pd):
    check_first_token_before_decode(pd, "/v1/chat/completions")


@pytest.mark.parametrize("bad", [[1 << 30], [-1], [1, 2], "x"])
def test_pull_first_token_outside_the_vocabulary_is_recomputed_or_refused(pd, bad):
    """A forged first token never reaches the model: out of range is recomputed (counted),
    a wrong type is a 400 naming the field."""
    body = completion_body(600, temperature=0.0, max_tokens=1)
    answer = post(pd.p.url, "/v1/completions",
                  {**body, "kv_transfer_params": {"do_remote_decode": True}})
    kv = {**answer["kv_transfer_params"], "do_remote_prefill": True, "first_token_ids": bad}
    kv.pop("do_remote_decode", None)
    import httpx

    before = metric(pd.d, RECOMPUTED), metric(pd.d, SEEDED)
    r = httpx.post(f"{pd.d.url}/v1/completions", json={**body, "max_tokens": 4,
                   "kv_transfer_params": kv}, timeout=120)
    if bad == "x" or bad == [-1]:
        assert r.status_code == 400 and "first_token_ids" in r.text
        return
    assert r.status_code == 200, r.text
    colocated = post(pd.d.url, "/v1/completions", {**body, "max_tokens": 4})
    assert r.json()["choices"][0]["text"] == colocated["choices"][0]["text"]
    assert (metric(pd.d, RECOMPUTED), metric(pd.d, SEEDED)) == (before[0] + 1, before[1])


def test_pull_prompt_tokenized_once_by_the_proxy(pd):
    check_tokenized_once(pd)


def test_pull_proxy_with_another_tokenizer_lets_the_engines_encode(pd, tiny_model,
                                                                   tmp_path):
    check_foreign_tokenizer_is_not_trusted(pd, foreign_tokenizer(tiny_model, str(tmp_path)))
