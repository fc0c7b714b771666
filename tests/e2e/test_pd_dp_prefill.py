"""P/D with P at data_parallel_size 2 behind one prefill server (push and pull), to a decode
server at DP=1 and one at DP=2 (one proxy each, so each pairs with both P ranks): every P rank
has its own side channel, NIXL agent and engine id (`_dp<rank>`); the proxy pins each P leg
to a rank and a push D leg names that rank. Outputs equal the colocated engine's, both P
ranks moved KV (per-rank counters), nothing leaks; killing P's rank-1 engine: the request
pinned to it is still answered (D recomputes), later ones go to rank 0. A client that knows no
ranks (vLLM's proxy) still works: push P legs it leaves unpinned run on rank 0, whose side
channel the top level of /kv_transfer/info names; in pull, P's answer names the rank."""

from __future__ import annotations

import os
import signal

import httpx
import openai
import pytest
from pd_harness import (
    TEST_ENV,
    assert_no_leaks,
    engine_stats,
    metric,
    per_engine,
    role_args,
    start_proxy,
    stop_all,
    wait_until,
)
from test_pd_dp_decode import CONNECTORS, PROMPTS, reference  # noqa: F401 (fixture)

from engine.net import free_port
from pdserve.launcher import launch_server
from proxy.kv_info import PrefillCoordinates
from proxy.legs import (
    COMPLETIONS,
    decode_leg_body,
    new_id,
    prefill_leg_body,
    pull_decode_params,
    pull_prefill_params,
    push_decode_params,
    push_prefill_params,
)

# P's side of a transfer: a registration received (push), a lease D gave back (pull)
P_COUNTER = {"push": "pdserve:kv_push_registrations_received_total",
             "pull": "pdserve:kv_pull_leases_returned_total"}


def _complete(proxy_url: str, prompts: list[list[int]]) -> list[str]:
    client = openai.OpenAI(base_url=proxy_url + "/v1", api_key="x", max_retries=0)
    return [client.completions.create(model="m", prompt=pr, max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
            for pr in prompts]


def _rank_unaware_client(p, d, mode: str, expected: str) -> None:
    """The legs of a proxy that knows nothing of ranks (vLLM's): P unpinned; push names the
    top-level coordinates of P's /kv_transfer/info, pull forwards P's answer."""
    info = httpx.get(p.url + "/kv_transfer/info", timeout=10).json()
    body = {"model": "m", "prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0,
            "ignore_eos": True}
    if mode == "push":
        tid = new_id()
        p_params = push_prefill_params(tid)
        d_params = push_decode_params(PrefillCoordinates.from_json(info, p.url), tid)
    else:
        p_params = pull_prefill_params()
    answer = httpx.post(p.url + "/v1/completions", json=prefill_leg_body(
        body, COMPLETIONS, p_params), timeout=60).json()
    if mode == "pull":  # P's answer names the rank the server picked
        d_params = pull_decode_params(answer)
        assert (d_params["remote_engine_id"], d_params["remote_port"]) in {
            (r["engine_id"], r["kv_port"]) for r in info["data_parallel_ranks"]}
    out = httpx.post(d.url + "/v1/completions", json=decode_leg_body(body, d_params),
                     timeout=60).json()
    assert out["choices"][0]["text"] == expected


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_prefill_at_dp2(tiny_model, reference, mode, tmp_path):  # noqa: F811
    conn = CONNECTORS[mode]
    procs = []
    try:
        p = launch_server(tiny_model, *role_args(256, None, conn, "P0", free_port(), "-dp", "2"),
                          module="prefill", env=TEST_ENV, wait=False,
                          log_path=str(tmp_path / "p.log"))
        procs.append(p)
        decodes = [launch_server(tiny_model, *role_args(256, None, conn, f"D{n}", free_port(),
                                                        "-dp", str(n)),
                                 module="decode", env=TEST_ENV, wait=False,
                                 log_path=str(tmp_path / f"d{n}.log")) for n in (1, 2)]
        procs += decodes
        for s in procs:
            s.wait_healthy(180)
        info = httpx.get(p.url + "/kv_transfer/info", timeout=10).json()
        ranks = info["data_parallel_ranks"]
        assert [(r["engine_id"], r["alive"]) for r in ranks] == [("P0_dp0", True),
                                                                ("P0_dp1", True)]
        assert ranks[1]["kv_port"] == ranks[0]["kv_port"] + 1
        # --retries 0: a leg pinned to a dead rank falls to the P-failure policy (D recomputes)
        # at once, which is what this test follows; a retry on another pair is test_proxy's
        proxies = [start_proxy([p.url], [d.url], mode, "--retries", "0") for d in decodes]
        procs += proxies
        for proxy in proxies:  # each proxy alternates P's ranks: both pair with both D's
            assert _complete(proxy.url, PROMPTS) == reference
        done = 2 * len(PROMPTS)
        wait_until(lambda: sum(per_engine(p, P_COUNTER[mode]).values()) == done, 10,
                   "P's transfers to settle")
        moved = per_engine(p, P_COUNTER[mode])
        assert moved == {"0": done / 2, "1": done / 2}
        assert sum(metric(d, "pdserve:kv_remote_prefill_tokens_total") for d in decodes) > 0
        assert all(v > 0 for v in per_engine(
            decodes[1], "pdserve:kv_remote_prefill_tokens_total").values())
        assert_no_leaks([p, *decodes])
        _rank_unaware_client(p, decodes[0], mode, reference[0])
        wait_until(lambda: sum(per_engine(p, P_COUNTER[mode]).values()) == done + 1, 10,
                   "the rank-unaware transfer to settle")
        if mode == "push":  # unpinned push P legs run on rank 0 (the top-level coordinates)
            assert per_engine(p, P_COUNTER[mode])["0"] == moved["0"] + 1
        moved = per_engine(p, P_COUNTER[mode])

        # P's rank-1 engine dies: /kv_transfer/info says so, the leg pinned to it fails and D
        # recomputes; the proxy re-reads P's ranks and sends the rest to rank 0.
        os.kill(engine_stats(p)["dp_engine_pids"][1], signal.SIGKILL)
        wait_until(lambda: engine_stats(p)["dead_engines"] == [1], 10, "P rank 1 dead")
        ranks = httpx.get(p.url + "/kv_transfer/info", timeout=10).json()["data_parallel_ranks"]
        assert [r["alive"] for r in ranks] == [True, False]
        proxy = proxies[0]  # its next legs: rank 0, rank 1 (dead), then rank 0 only
        assert _complete(proxy.url, PROMPTS[:4]) == reference[:4]
        wait_until(lambda: per_engine(p, P_COUNTER[mode]).get("0") == moved["0"] + 3, 10,
                   "three transfers from P rank 0")
        assert metric(proxy, 'pdserve:proxy_prefill_leg_failures_total{action="recompute"}'
                      ) == 1
        assert metric(decodes[0], "pdserve:kv_recompute_fallback_total") == (
            1 if mode == "push" else 0)  # pull: D got no params, so it just computes
        assert_no_leaks([p, *decodes])
    finally:
        stop_all(procs)
