"""The vLLM drop-in through a P/D deployment (issue 32): the proxy answers the engines'
helper routes (/tokenize, /detokenize, /version, /tokenizer_info) from a decode backend, and
a loglikelihood request (echo + logprobs) gets every prompt token's logprob, equal to
transformers', from the one engine that prefills it (D alone: a decode leg receiving P's KV
computes no prompt rows); engines with a connector export the kv_* series. The same
deployment proves vLLM's metric families on a live P and D under load (names, types, labels,
buckets) and that every query of the Grafana dashboard names a live series.
"""

from __future__ import annotations

import httpx
import pytest
from pd_harness import deployment, metric, wait_until

PROMPT = [3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41]


@pytest.fixture(scope="module")
def dep(tiny_model: str):
    with deployment(tiny_model, "push", num_blocks=128, engine_args=("--dtype", "float32")) as d:
        yield d


def test_helper_routes_through_the_proxy(dep):
    proxy, d = dep.proxy.url, dep.d.url
    tok = httpx.post(proxy + "/tokenize", json={"prompt": "hello world"}, timeout=30)
    assert tok.status_code == 200
    assert tok.json() == httpx.post(d + "/tokenize", json={"prompt": "hello world"}).json()
    ids = tok.json()["tokens"]
    detok = httpx.post(proxy + "/detokenize", json={"tokens": ids}, timeout=30)
    assert detok.status_code == 200 and "hello world" in detok.json()["prompt"]
    for path in ("/version", "/tokenizer_info"):
        r = httpx.get(proxy + path, timeout=30)
        assert r.status_code == 200 and r.json() == httpx.get(d + path).json()
    bad = httpx.post(proxy + "/detokenize", json={"tokens": [10**9]}, timeout=30)
    assert bad.status_code == 400 and "tokens" in bad.text  # D's own 400, relayed


def test_echo_logprobs_through_the_proxy_equal_transformers(dep, tiny_model: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        lp = model(torch.tensor([PROMPT])).logits[0].float().log_softmax(-1)
    ref = [lp[i - 1, PROMPT[i]].item() for i in range(1, len(PROMPT))]
    p_prompts = metric(dep.p, "pdserve:prompt_tokens_total")
    r = httpx.post(dep.proxy.url + "/v1/completions", json={
        "model": "m", "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 1},
        timeout=60)
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert got[0] is None
    assert max(abs(a - b) for a, b in zip(got[1:len(PROMPT)], ref, strict=True)) < 1e-4
    assert metric(dep.p, "pdserve:prompt_tokens_total") == p_prompts  # P never saw it
    assert "pdserve:kv_push_writes_total" in httpx.get(dep.p.url + "/metrics").text


def test_prompt_logprobs_refused_on_a_decode_leg_receiving_kv(dep):
    """A D leg whose prompt KV comes from P runs no prefill forward: no prompt rows to give."""
    info = httpx.get(dep.p.url + "/kv_transfer/info", timeout=10).json()
    r = httpx.post(dep.d.url + "/v1/completions", json={
        "model": "m", "prompt": PROMPT, "prompt_logprobs": 1, "max_tokens": 1,
        "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": info["engine_id"],
                               "remote_host": info["kv_host"], "remote_port": info["kv_port"],
                               "tp_size": info["tp_size"]}}, timeout=30)
    assert r.status_code == 400 and "prompt_logprobs" in r.text


# ---- vLLM's metrics and the Grafana dashboard (issue 32 item 1) --------------------------


def _load(dep, n: int = 3) -> dict:
    """`n` short requests through the proxy, and one long stream held open while P, D and
    the proxy are scraped (D still decoding it). Returns those scrapes by role."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    from vllm_metrics_kit import scrape

    def short(i: int) -> int:
        return httpx.post(dep.proxy.url + "/v1/completions", json={
            "model": "m", "prompt": PROMPT[i:], "max_tokens": 6, "ignore_eos": True},
            timeout=60).status_code

    body = {"model": "m", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    with ThreadPoolExecutor(n) as pool, httpx.stream(
            "POST", dep.proxy.url + "/v1/completions", json=body, timeout=60) as stream:
        shorts = [pool.submit(short, i) for i in range(n)]
        lines = stream.iter_lines()
        tokens = 0
        for line in lines:  # token 2: D is decoding the stream now (token 1 may be P's,
            if line.startswith("data: ") and json.loads(line[6:])["choices"]:  # sent while
                tokens += 1  # D still waits for the KV)
                if tokens == 2:
                    break
        live = {name: scrape(s.url) for name, s in
                (("P", dep.p), ("D", dep.d), ("proxy", dep.proxy))}
        for _ in lines:
            pass
        assert [f.result() for f in shorts] == [200] * n
    return live


def test_vllm_series_on_live_p_and_d_under_load(dep):
    """vLLM's families on P and D, scraped while a stream is decoding on D: names, types,
    label names, bucket bounds; D counts the stream as running; after the load each family
    counted the requests (D its 4 finishes and P its transfers into the kv histogram)."""
    from vllm_metrics_kit import REQUEST, check_vllm_families, scrape, value

    d0 = value(scrape(dep.d.url), "vllm:request_success_total", finished_reason="length")
    live = _load(dep)
    for role in ("P", "D"):
        assert check_vllm_families(live[role], "m") == [], role
    assert value(live["D"], "vllm:num_requests_running") >= 1  # the open stream

    def finished() -> float:
        return value(scrape(dep.d.url), "vllm:request_success_total",
                     finished_reason="length") - d0

    wait_until(lambda: finished() >= 4, 30, "D to count the 4 finishes")
    d, p, proxy = scrape(dep.d.url), scrape(dep.p.url), scrape(dep.proxy.url)
    assert check_vllm_families(d, "m") == [] and check_vllm_families(p, "m") == []
    for fam in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                "request_queue_time_seconds", "request_decode_time_seconds",
                "inter_token_latency_seconds", "request_generation_tokens"):
        assert value(d, f"vllm:{fam}_count") >= 4, fam
    assert value(d, "vllm:generation_tokens_total") >= 400 + 3 * 6
    assert value(d, "vllm:request_decode_time_seconds_sum") > 0
    assert value(p, "vllm:prompt_tokens_total") > 0  # P prefilled the legs
    # our own e2e histogram has vLLM's request-latency buckets (up to 7680 s), not TTFT's
    from vllm_metrics_kit import bounds
    assert bounds(d["pdserve:e2e_request_latency_seconds"]) == REQUEST
    # the KV transfer time is a histogram (aiperf reads no quantile-less Summary), counted
    kv = p["pdserve:kv_transfer_seconds"]
    assert kv.type == "histogram" and len(bounds(kv)) >= 5
    assert value(p, "pdserve:kv_transfer_seconds_count") >= 4
    assert value(p, "pdserve:kv_transfer_seconds_bucket", le="+Inf") == value(
        p, "pdserve:kv_transfer_seconds_count")
    assert value(proxy, "pdserve:proxy_ttft_seconds_count") >= 4
    assert bounds(proxy["pdserve:proxy_e2e_request_latency_seconds"]) == REQUEST


def test_grafana_dashboard_queries_name_live_series(dep):
    """Every PromQL query of docs/grafana/pdserve.json names series that exist on a live P
    and D (engine series) or on the live proxy (pdserve:proxy_*), after a few requests; the
    JSON is what docs/grafana/make_dashboard.py writes."""
    import importlib.util
    import json

    from vllm_metrics_kit import DASHBOARD, dashboard_queries, metric_names

    spec = importlib.util.spec_from_file_location(
        "make_dashboard", DASHBOARD.with_name("make_dashboard.py"))
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    board = json.loads(DASHBOARD.read_text())
    assert board == json.loads(json.dumps(gen.dashboard())), "regenerate pdserve.json"
    for i in range(2):
        r = httpx.post(dep.proxy.url + "/v1/completions", json={
            "model": "m", "prompt": PROMPT[i:], "max_tokens": 3}, timeout=60)
        assert r.status_code == 200, r.text
    names = set().union(*(metric_names(q) for q in dashboard_queries(board)))
    for must in ("vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_hits_total", "vllm:generation_tokens_total",
                 "pdserve:kv_transfer_seconds_bucket", "pdserve:proxy_ttft_seconds_bucket"):
        assert must in names, f"the dashboard has no panel on {must}"
    exported = {}
    for role, server in (("P", dep.p), ("D", dep.d), ("proxy", dep.proxy)):
        text = httpx.get(server.url + "/metrics", timeout=10).text
        exported[role] = {line.split("{")[0].split(" ")[0] for line in text.splitlines()
                          if line and not line.startswith("#")}
    missing = [(n, role) for n in sorted(names)
               for role in (("proxy",) if n.startswith("pdserve:proxy_") else ("P", "D"))
               if n not in exported[role]]
    assert missing == []


def test_each_phase_of_a_request_is_counted(dep):
    """Issue 28 item 5: one streamed request through the push proxy is counted by every phase's
    histogram (P's queue and prefill, the KV transfer on P, D's wait for KV, the proxy's hop)
    and the phases on the path to the client's first byte (P's queue, P's prefill, the proxy's
    dispatch and relay) sum to no more than the TTFT the client saw; the transfer sits inside
    D's wait."""
    import json
    import time

    p_phases = ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                "pdserve:kv_transfer_seconds")
    where = {**dict.fromkeys(p_phases, dep.p), "pdserve:kv_wait_seconds": dep.d,
             "pdserve:proxy_hop_seconds": dep.proxy}

    def read() -> dict[str, tuple[float, float]]:
        return {n: (metric(s, n + "_count"), metric(s, n + "_sum")) for n, s in where.items()}

    before = read()
    body = {"model": "m", "prompt": PROMPT * 4, "max_tokens": 4, "stream": True}
    started, ttft = time.monotonic(), None
    with httpx.stream("POST", dep.proxy.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if ttft is None and line.startswith("data: {"):
                ttft = time.monotonic() - started
                assert json.loads(line[6:])["choices"]
    assert ttft is not None
    # one each (the hop: its dispatch and relay parts); P and D record theirs on their own time
    want = {n: 2 if n == "pdserve:proxy_hop_seconds" else 1 for n in where}
    wait_until(lambda: all(read()[n][0] - before[n][0] >= k for n, k in want.items()), 30,
               "every phase histogram to count the request")
    after = read()
    took = {n: after[n][1] - before[n][1] for n in where}
    assert all(after[n][0] - before[n][0] == k for n, k in want.items()), (before, after)
    on_path = (took["vllm:request_queue_time_seconds"] + took["vllm:request_prefill_time_seconds"]
               + took["pdserve:proxy_hop_seconds"])
    assert 0 < on_path <= ttft, (took, ttft)
    # (a tiny model's WRITE can complete in the pass that posted it: 0.0 on P's clock)
    assert 0 <= took["pdserve:kv_transfer_seconds"] <= took["pdserve:kv_wait_seconds"], took
