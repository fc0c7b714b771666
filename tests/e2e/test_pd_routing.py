"""2P1D push with the kv-aware proxy: every engine publishes KV events, the proxy tokenizes.

A conversation's next turn goes to the P that holds its history; a short follow-up turn, whose
uncached part on D is below --disagg-min-tokens, runs on D alone; answers equal colocated."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import httpx
import pytest
from pd_harness import TEST_ENV, _log_path, role_args, start_proxy, stop_all
from prometheus_client.parser import text_string_to_metric_families

from engine import LLM, SamplingParams
from engine.net import free_port
from pdserve.launcher import ServerProcess, launch_server

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 4
MIN_TOKENS = 24  # --disagg-min-tokens


def _events_config(port: int) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{port + 1}"})


@pytest.fixture(scope="module")
def cluster(tiny_model: str) -> Iterator[tuple[list[ServerProcess], ServerProcess]]:
    procs: list[ServerProcess] = []
    try:
        engines, sources = [], []
        for name, module in (("P0", "prefill"), ("P1", "prefill"), ("D0", "decode")):
            events = free_port(count=2)
            server = launch_server(
                tiny_model, *role_args(256, None, "NixlPushConnector", name,
                                       free_port(count=2), "--kv-events-config",
                                       _events_config(events)),
                module=module, env=TEST_ENV, wait=False, log_path=_log_path(name))
            procs.append(server)
            engines.append(server)
            sources.append(f"{server.url}=tcp://127.0.0.1:{events},tcp://127.0.0.1:{events + 1}")
        for s in engines:
            s.wait_healthy(180)
        args = ["--tokenizer", tiny_model, "--disagg-min-tokens", str(MIN_TOKENS)]
        for source in sources:
            args += ["--kv-events", source]
        proxy = start_proxy([e.url for e in engines[:2]], [engines[2].url], "push", *args)
        procs.append(proxy)
        yield engines, proxy
    finally:
        stop_all(procs)


@pytest.fixture(scope="module")
def reference(tiny_model: str):
    llm = LLM(tiny_model, num_kv_blocks=256, max_model_len=1024, multiprocess=False)

    def run(prompt: list[int]) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    yield run
    llm.shutdown()


def _samples(proxy: ServerProcess, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    text = httpx.get(f"{proxy.url}/metrics", timeout=10).text
    return {tuple(sorted(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if s.name == name}


def _turn(proxy: ServerProcess, prompt: list[int]) -> tuple[str, str]:
    """Send one turn; returns (the P it went to, "" for D alone; the answer's text)."""
    name = "pdserve:proxy_route_pairs_total"
    before = _samples(proxy, name)
    r = httpx.post(f"{proxy.url}/v1/completions", timeout=120, json={
        "model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    after = _samples(proxy, name)
    (labels,) = [k for k, v in after.items() if v != before.get(k, 0)]
    return dict(labels)["prefill"], r.json()["choices"][0]["text"]


def _text(tiny_model: str, ids: list[int]) -> str:
    from engine.models.tokenizer import Tokenizer

    return Tokenizer.from_dir(tiny_model).decode(ids)


def test_a_turn_goes_to_the_p_holding_its_history(cluster, reference, tiny_model):
    (p0, p1, _), proxy = cluster
    rng = random.Random(5)
    a1, b1 = ([rng.randrange(4, 2000) for _ in range(100)] for _ in range(2))
    a2, b2 = a1 + [rng.randrange(4, 2000) for _ in range(40)], b1 + [9] * 40
    pa, text = _turn(proxy, a1)
    assert text == _text(tiny_model, reference(a1))
    pb, _ = _turn(proxy, b1)
    assert {pa, pb} == {p0.url, p1.url}  # empty caches: the load ties, round-robin
    # B's turn 2 next: the tie-break would pick A's P, the cache picks B's
    assert _turn(proxy, b2)[0] == pb
    pa2, text = _turn(proxy, a2)
    assert pa2 == pa and text == _text(tiny_model, reference(a2))
    matched = _samples(proxy, "pdserve:proxy_prefix_matched_tokens_total")
    assert matched[(("role", "prefill"), ("url", pa))] >= 96


def test_a_short_follow_up_runs_on_d_alone_and_equals_colocated(cluster, reference, tiny_model):
    _, proxy = cluster
    rng = random.Random(6)
    c1 = [rng.randrange(4, 2000) for _ in range(120)]
    assert _turn(proxy, c1)[0] != ""  # D holds nothing of it yet: disaggregated
    c2 = c1 + [rng.randrange(4, 2000) for _ in range(10)]  # D lacks 130 - 112 < 24 tokens
    before = _samples(proxy, "pdserve:proxy_routing_decisions_total")
    prefill, text = _turn(proxy, c2)
    assert prefill == "" and text == _text(tiny_model, reference(c2))
    after = _samples(proxy, "pdserve:proxy_routing_decisions_total")
    key = (("policy", "kv-aware"), ("reason", "short_uncached"))
    assert after[key] == before.get(key, 0) + 1


def _d_metric(d: ServerProcess, name: str) -> float:
    text = httpx.get(f"{d.url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name)


def test_d_alone_hits_its_cache_of_the_received_kv_and_its_own_answer(cluster):
    """D keeps what P pushed and what it decoded in its prefix cache: a D-alone follow-up
    computes only its new tokens (usage's cached_tokens), and vllm:prefix_cache_hits (read
    0 on every scrape before: /metrics replaced the step's stats without it) counts them."""
    (_, _, d), proxy = cluster
    rng = random.Random(7)
    c1 = [rng.randrange(4, 2000) for _ in range(96)]
    assert _turn(proxy, c1)[0] != ""  # disaggregated: D received all 96 tokens' KV from P
    r = httpx.post(f"{proxy.url}/v1/completions", timeout=120, json={
        "model": "m", "prompt": c1, "max_tokens": 17, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, "stream": True})
    answer = [t for line in r.text.splitlines() if line.startswith("data: {")
              for c in json.loads(line[6:])["choices"] for t in c.get("token_ids") or []]
    assert len(answer) == 17
    hits = _d_metric(d, "vllm:prefix_cache_hits_total")
    c2 = c1 + answer + [rng.randrange(4, 2000) for _ in range(5)]  # 118 tokens
    r = httpx.post(f"{d.url}/v1/completions", timeout=120, json={
        "model": "m", "prompt": c2, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    # 96 received + 16 of its own answer (the 17th was never computed): 7 full blocks
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 112
    assert _d_metric(d, "vllm:prefix_cache_hits_total") - hits == 112
    assert _d_metric(d, "vllm:prefix_cache_queries_total") >= len(c2)
