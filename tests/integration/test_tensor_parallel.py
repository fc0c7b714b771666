"""Tensor parallelism across real processes: `pdserve serve --tensor-parallel-size 2` runs
EngineCore + 2 worker processes; a worker that dies (busy or idle) fails every request fast
and the API server keeps answering; P/D roles with TP > 1 are refused naming why."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest
from pd_harness import wait_until
from server_streams import Stream, assert_died_fast

from pdserve.launcher import launch_server

MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def tp_servers(tiny_model: str, tmp_path_factory: pytest.TempPathFactory):
    """Two TP=2 servers started together: one busy when a worker dies, one idle."""
    logs = str(tmp_path_factory.mktemp("tp-logs"))
    servers = {name: launch_server(
        tiny_model, "--served-model-name", "tiny", "--num-kv-blocks", "256",
        "--max-model-len", str(MAX_MODEL_LEN), "--tensor-parallel-size", "2", wait=False,
        log_path=os.path.join(logs, f"{name}.log")) for name in ("busy", "idle")}
    try:
        for s in servers.values():
            s.wait_healthy(300)
        yield servers
    finally:
        for s in servers.values():
            s.stop()


@pytest.fixture(scope="module")
def tp_server(tp_servers):
    return tp_servers["busy"]


def _stats(url: str) -> dict:
    return httpx.get(url + "/engine_stats", timeout=10).json()


def test_tp2_server_runs_engine_core_and_two_workers(tp_server):
    r = httpx.post(tp_server.url + "/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": "hello", "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    pids = _stats(tp_server.url)["tp_worker_pids"]
    assert len(pids) == 2
    workers = [psutil.Process(p) for p in pids]
    core = workers[0].parent()
    assert workers[1].parent().pid == core.pid and core.parent().pid == tp_server.pid


def test_killing_one_worker_fails_every_request_fast_and_the_server_answers(tp_server):
    longest = MAX_MODEL_LEN - 16
    streams = [Stream(tp_server.url, longest) for _ in range(3)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.first.wait(120) and s.status == 200 and s.events
    pids = _stats(tp_server.url)["tp_worker_pids"]
    survivors = [psutil.Process(p) for p in pids[:1]]
    core = survivors[0].parent()
    os.kill(pids[1], signal.SIGKILL)
    killed = time.monotonic()
    assert_died_fast(streams, killed, tp_server)
    # No orphans: the engine core and the other worker go away too.
    wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                               for p in [core, *survivors]), 30, "core and worker 0 to exit")


def test_a_worker_dying_while_the_engine_is_idle_marks_it_dead_at_once(tp_servers):
    server = tp_servers["idle"]
    pids = _stats(server.url)["tp_worker_pids"]
    os.kill(pids[0], signal.SIGKILL)
    killed = time.monotonic()

    def dead() -> bool:
        return httpx.get(server.url + "/health", timeout=5).status_code == 503

    wait_until(dead, 2.0, "/health to report the dead engine")
    assert time.monotonic() - killed < 2.0
    r = httpx.post(server.url + "/v1/completions", timeout=5,
                   json={"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def test_pd_with_tp_above_one_refuses_pull_and_unaddressed_ranks_with_a_clear_error(tiny_model):
    """Push supports TP > 1 (tests/e2e/test_pd_push_tp.py); pull does not yet, and a TP
    engine's ranks need a fixed kv_port (rank r: kv_port + r) and engine id."""
    from engine.config import EngineConfig

    pull = {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "engine_id": "P",
            "kv_port": 5000}
    with pytest.raises(ValueError, match="NixlConnector .pull mode. with tensor_parallel_size"):
        EngineConfig(model=tiny_model, tensor_parallel_size=2, kv_transfer_config=pull)
    push = {"kv_connector": "NixlPushConnector", "kv_role": "kv_producer", "engine_id": "P"}
    with pytest.raises(ValueError, match="needs an explicit kv_port"):
        EngineConfig(model=tiny_model, tensor_parallel_size=2, kv_transfer_config=push)
    with pytest.raises(ValueError, match="needs an explicit engine_id"):
        EngineConfig(model=tiny_model, tensor_parallel_size=2,
                     kv_transfer_config={**push, "engine_id": "", "kv_port": 5000})
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "decode", tiny_model,
                        "--kv-connector", "NixlConnector", "--tensor-parallel-size", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "(pull mode) with tensor_parallel_size > 1 is not supported yet" in r.stderr


def test_tp2_sampling_and_logprobs_equal_tp1_and_ranks_stay_in_step(tiny_model):
    """Seeded sampling draws the same tokens at TP=2 as at TP=1 and logprobs cross the
    response ring intact. Unseeded sampling keeps the ranks in step: a greedy request that
    reuses (prefix cache) the blocks of a sampled continuation equals TP=1 computing it
    from scratch — had rank 1 sampled other tokens, its KV for those blocks would differ."""
    from engine import LLM, SamplingParams

    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=24, logprobs=2,
                            ignore_eos=True)
    free = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = ["The seeded one", "another prompt here"]

    def ids(outs) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in outs]

    tp2 = LLM(tiny_model, num_kv_blocks=128, multiprocess=False, tensor_parallel_size=2)
    seeded2 = tp2.generate(prompts, seeded, use_tqdm=False)
    sampled = tp2.generate(prompts, free, use_tqdm=False)
    conts = [{"prompt_token_ids": list(o.prompt_token_ids) + list(o.outputs[0].token_ids)}
             for o in sampled]
    reused = tp2.generate(conts, greedy, use_tqdm=False)
    assert all(o.num_cached_tokens >= 32 for o in reused), [o.num_cached_tokens for o in reused]
    tp2.shutdown()
    tp1 = LLM(tiny_model, num_kv_blocks=128, multiprocess=False)
    seeded1 = tp1.generate(prompts, seeded, use_tqdm=False)
    fresh = tp1.generate(conts, greedy, use_tqdm=False)
    tp1.shutdown()
    assert ids(seeded2) == ids(seeded1) and ids(reused) == ids(fresh)
    for a, b in zip(seeded1, seeded2, strict=True):
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert len(la) == len(lb) == 24
        for pa, pb in zip(la, lb, strict=True):
            assert pa.keys() == pb.keys() and all(abs(pa[t] - pb[t]) < 1e-3 for t in pa)
