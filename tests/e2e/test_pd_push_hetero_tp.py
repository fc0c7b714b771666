"""P/D push between engines of different tensor-parallel sizes (docs/design.md §8), through
the proxy: P TP=2 → D TP=1 and P TP=1 → D TP=2.

Each WRITE moves only the KV heads the two ranks share, as per-(layer, K/V, token) runs into
the right part of the peer's blocks. Outputs must equal colocated TP=1 token for token, the
KV must really move (D computes only the last prompt token), every request costs exactly
one WRITE per (P rank, D rank) pair holding common heads, and nothing leaks on any rank.
"""

from __future__ import annotations

import asyncio

import pytest
from pd_harness import assert_no_leaks, deployment, metric
from test_pd_push import REMOTE_TOKENS, _complete_all, _detok, _prompts
from test_pd_push import reference as reference  # noqa: F401 - the module fixture

TP2 = ("--tensor-parallel-size", "2")
WRITES = "pdserve:kv_push_writes_total"
REGS = "pdserve:kv_push_registrations_sent_total"


@pytest.mark.parametrize(("p_args", "d_args"), [(TP2, ()), ((), TP2)],
                         ids=["p2-d1", "p1-d2"])
def test_hetero_tp_push_matches_colocated_tp1_and_writes_each_head_once(
        tiny_model, reference, p_args, d_args):
    with deployment(tiny_model, "push", num_blocks=256, p_args=p_args, d_args=d_args) as dep:
        p, d = dep.p, dep.d
        prompts = _prompts(6, seed=13)
        before = metric(d, REMOTE_TOKENS)
        writes, regs = metric(p, WRITES), metric(d, REGS)
        texts = asyncio.run(_complete_all(dep.proxy.url, prompts))
        assert texts == _detok(tiny_model, reference(prompts))
        assert metric(d, REMOTE_TOKENS) - before == sum(len(q) - 1 for q in prompts)
        # 2 KV heads: each (P rank, D rank) pair shares one head, and there are 2 such pairs;
        # one PUSH_REG and one WRITE per pair (counters are summed over each engine's ranks)
        assert metric(p, WRITES) - writes == 2 * len(prompts)
        assert metric(d, REGS) - regs == 2 * len(prompts)
        assert_no_leaks(dep.engines)
