"""P/D with P at tensor_parallel_size 2 AND data_parallel_size 2 (four P ranks behind one
prefill server), D at TP=1, push, through the proxy.

The connector's port layout puts data-parallel rank d's tensor-parallel rank t at
kv_port + d * 2 + t, so no two of P's side channels collide (the engine refused this
combination before: both kinds of rank sat at kv_port + rank). P advertises every rank's ports
at /kv_transfer/info; the proxy pins each P leg to a DP rank and names that rank's side
channel in D's leg; D's one rank registers with both TP ranks of that DP rank. Greedy outputs
equal a colocated engine's, both DP ranks of P wrote KV, and nothing leaks.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from pd_harness import (
    TEST_ENV,
    assert_no_leaks,
    metric,
    per_engine,
    role_args,
    start_proxy,
    stop_all,
    wait_until,
)

from engine.net import free_port
from pdserve.launcher import launch_server

CONNECTOR = "NixlPushConnector"
PROMPTS = [[3 + i, 5, 7, 11, 13, 17, 19, 23, 29, 31][: 6 + i] * 2 for i in range(4)]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def reference(tiny_model: str) -> list[str]:
    from engine import LLM, SamplingParams

    llm = LLM(tiny_model, multiprocess=False, num_kv_blocks=128, max_model_len=1024)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                           ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    return [o.outputs[0].text for o in outs]


def test_prefill_at_tp2_dp2_pushes_to_decode_through_the_proxy(tiny_model, reference, tmp_path):
    base = free_port(count=4)  # 2 DP ranks x 2 TP ranks of side channels
    procs = []
    try:
        p = launch_server(tiny_model, *role_args(128, None, CONNECTOR, "P0", base,
                                                 "--tensor-parallel-size", "2",
                                                 "--data-parallel-size", "2"),
                          module="prefill", env=TEST_ENV, wait=False,
                          log_path=str(tmp_path / "p.log"))
        procs.append(p)
        d = launch_server(tiny_model, *role_args(128, None, CONNECTOR, "D0", free_port(count=1)),
                          module="decode", env=TEST_ENV, wait=False,
                          log_path=str(tmp_path / "d.log"))
        procs.append(d)
        for s in procs:
            s.wait_healthy(300)

        info = httpx.get(p.url + "/kv_transfer/info", timeout=10).json()
        assert (info["tp_size"], info["kv_port"], info["kv_ports"]) == (2, base, [base, base + 1])
        assert [(r["rank"], r["engine_id"], r["kv_port"], r["kv_ports"], r["alive"])
                for r in info["data_parallel_ranks"]] == [
            (0, "P0_dp0", base, [base, base + 1], True),
            (1, "P0_dp1", base + 2, [base + 2, base + 3], True)]

        proxy = start_proxy([p.url], [d.url], "push")
        procs.append(proxy)
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
        outs = [client.completions.create(model="m", prompt=pr, max_tokens=MAX_TOKENS,
                                          temperature=0, extra_body={"ignore_eos": True}
                                          ).choices[0].text for pr in PROMPTS]
        assert outs == reference

        # every request: one WRITE from each of the pinned DP rank's two TP ranks
        done = 2 * len(PROMPTS)
        wait_until(lambda: sum(per_engine(p, "pdserve:kv_push_writes_total").values()) == done,
                   20, "P's WRITEs to settle")
        writes = per_engine(p, "pdserve:kv_push_writes_total")
        assert writes == {"0": done / 2, "1": done / 2}, writes  # the proxy alternates ranks
        assert metric(d, "pdserve:kv_recompute_fallback_total") == 0
        assert metric(d, "pdserve:kv_remote_prefill_tokens_total") > 0
        assert_no_leaks([p, d])
    finally:
        stop_all(procs)
