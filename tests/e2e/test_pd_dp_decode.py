"""P/D with D at data_parallel_size 2 behind one decode server (push and pull): each D rank has
its own side channel, NIXL agent and engine id (`_dp<rank>`), and registers with / reads from
P by itself; the proxy and P see one decode server. Outputs equal the colocated engine's,
every rank moved KV (per-rank counters), nothing leaks; killing one D engine fails only its
requests and the deployment keeps serving on the other rank."""

from __future__ import annotations

import os
import signal

import httpx
import openai
import pytest
from pd_harness import (
    TEST_ENV,
    assert_no_leaks,
    per_engine,
    role_args,
    start_proxy,
    stop_all,
    wait_until,
)

from engine.net import free_port
from pdserve.launcher import launch_server

CONNECTORS = {"push": "NixlPushConnector", "pull": "NixlConnector"}
COUNTER = {"push": "pdserve:kv_push_registrations_sent_total",
           "pull": "pdserve:kv_pull_reads_total"}
PROMPTS = [[3 + i, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59][: 9 + i] * 3
           for i in range(6)]


@pytest.fixture(scope="module")
def reference(tiny_model: str) -> list[str]:
    from engine import LLM, SamplingParams

    llm = LLM(tiny_model, multiprocess=False, num_kv_blocks=256, max_model_len=1024)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    return [o.outputs[0].text for o in outs]


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_decode_at_dp2(tiny_model, reference, mode, tmp_path):
    conn = CONNECTORS[mode]
    procs = []
    try:
        p = launch_server(tiny_model, *role_args(256, None, conn, "P0", free_port()),
                          module="prefill", env=TEST_ENV, wait=False,
                          log_path=str(tmp_path / "p.log"))
        procs.append(p)
        d = launch_server(tiny_model, *role_args(256, None, conn, "D0", free_port(), "-dp", "2"),
                          module="decode", env=TEST_ENV, wait=False,
                          log_path=str(tmp_path / "d.log"))
        procs.append(d)
        for s in procs:
            s.wait_healthy(180)
        info = httpx.get(d.url + "/kv_transfer/info", timeout=10).json()
        ranks = info["data_parallel_ranks"]
        assert [r["engine_id"] for r in ranks] == ["D0_dp0", "D0_dp1"]
        assert ranks[1]["kv_port"] == ranks[0]["kv_port"] + 1
        proxy = start_proxy([p.url], [d.url], mode)
        procs.append(proxy)
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)

        def run(prompts: list[list[int]]) -> list[str]:
            return [client.completions.create(
                model="m", prompt=pr, max_tokens=10, temperature=0,
                extra_body={"ignore_eos": True}).choices[0].text for pr in prompts]

        assert run(PROMPTS) == reference
        moved = per_engine(d, COUNTER[mode])
        assert moved.get("0", 0) > 0 and moved.get("1", 0) > 0
        assert moved["0"] + moved["1"] == len(PROMPTS)
        received = per_engine(d, "pdserve:kv_remote_prefill_tokens_total")
        assert received["0"] > 0 and received["1"] > 0
        assert_no_leaks([p, d])
        # One D engine dies: the other rank keeps serving the deployment.
        os.kill(httpx.get(d.url + "/engine_stats", timeout=10).json()["dp_engine_pids"][1],
                signal.SIGKILL)
        wait_until(lambda: httpx.get(d.url + "/engine_stats", timeout=10).json()[
            "dead_engines"] == [1], 10, "D rank 1 reported dead")
        assert run(PROMPTS[:3]) == reference[:3]
        after = per_engine(d, COUNTER[mode])
        assert after["0"] == moved["0"] + 3
    finally:
        stop_all(procs)
