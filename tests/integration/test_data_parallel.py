"""Data parallel behind one API server (`--data-parallel-size 2`), end to end: real server
processes (python -m engine.server), two EngineCore processes each plus the coordinator,
driven by the official `openai` client.

Which engine served a request is read from the per-engine metrics (engine="<rank>") and
from /engine_stats (`engines`, `dp_published_counts`, `dead_engines`).
"""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import openai
import psutil
import pytest
from pd_harness import stop_all, wait_until
from prometheus_client.parser import text_string_to_metric_families

from pdserve.launcher import ServerProcess, launch_server

MODEL = "tiny"
COMMON = ["--served-model-name", MODEL, "--num-kv-blocks", "256", "--max-model-len", "512"]


def _start(tiny_model: str, log_dir: str, name: str, *args: str) -> ServerProcess:
    return launch_server(tiny_model, *COMMON, *args, wait=False,
                         log_path=os.path.join(log_dir, f"{name}.log"))


@pytest.fixture(scope="module")
def servers(tiny_model: str, tmp_path_factory: pytest.TempPathFactory):
    log_dir = str(tmp_path_factory.mktemp("dp-logs"))
    started = {
        "dp": _start(tiny_model, log_dir, "dp", "-dp", "2", "--max-num-seqs", "2"),
        "death": _start(tiny_model, log_dir, "death", "-dp", "2"),
        "ext": _start(tiny_model, log_dir, "ext", "--data-parallel-size", "2",
                      "--data-parallel-external-lb", "--data-parallel-rank", "1"),
    }
    try:
        for s in started.values():
            s.wait_healthy(300)
        yield started
    finally:
        stop_all(list(started.values()))  # side by side: each drains its ranks on its own


@pytest.fixture(scope="module")
def server(servers) -> ServerProcess:
    return servers["dp"]


def _client(server: ServerProcess, cls=openai.OpenAI):
    return cls(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _stats(server: ServerProcess) -> dict:
    return httpx.get(server.url + "/engine_stats", timeout=30).json()


def _samples(server: ServerProcess, name: str) -> dict[str, float]:
    """engine label -> value of metric sample `name` (summed over other labels)."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[s.labels["engine"]] = out.get(s.labels["engine"], 0.0) + s.value
    return out


def _idle(server: ServerProcess) -> bool:
    st = _stats(server)
    return (st["num_unfinished_requests"] == 0 and st["num_free_blocks"] == st["num_kv_blocks"]
            and st["dp_outstanding"] == [0, 0])


def _prompt_ids(n: int, start: int = 5) -> list[int]:
    return [start + (i * 7) % 900 for i in range(n)]


FINISHED = "pdserve:request_success_total"


def test_metrics_carry_each_engine(server):
    client = _client(server)
    client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
    for name in ("pdserve:num_requests_running", "pdserve:generation_tokens_total",
                 "pdserve:num_free_kv_blocks"):
        assert set(_samples(server, name)) == {"0", "1"}, name
    st = _stats(server)
    assert set(st["engines"]) == {"0", "1"} and st["dead_engines"] == []
    assert st["dp_publications"] > 0  # the coordinator publishes to the frontend


def test_pinning_reaches_the_pinned_engine(server):
    client = _client(server)
    for rank in (1, 0, 1):
        before = _samples(server, FINISHED)
        client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=3,
                                  extra_body={"data_parallel_rank": rank, "ignore_eos": True})
        after = _samples(server, FINISHED)
        assert after[str(rank)] == before.get(str(rank), 0) + 1
        assert after[str(1 - rank)] == before.get(str(1 - rank), 0)


def test_out_of_range_rank_is_a_400(server):
    client = _client(server)
    for bad in (2, -1):
        with pytest.raises(openai.BadRequestError) as exc:
            client.completions.create(model=MODEL, prompt="x", max_tokens=1,
                                      extra_body={"data_parallel_rank": bad})
        assert "data_parallel_rank" in str(exc.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=1, extra_body={"data_parallel_rank": 9})


def test_skewed_load_sends_new_requests_to_the_idle_engine(server):
    """Six long requests pinned to rank 0 (max 2 running: 4 wait there); once the
    coordinator has published that, four unpinned requests all go to rank 1. Less of a bet
    on the CPU's speed: each long request decodes 480 tokens, so rank 0 stays at [4, 2] for
    480 steps (many 0.1 s publications), and once that was published the test holds rank 0
    (SIGSTOP) until the four are answered, so it cannot drain its queue meanwhile."""
    wait_until(lambda: _idle(server), 60, "idle engines")
    client = _client(server, openai.AsyncOpenAI)
    before = _samples(server, FINISHED)
    rank0 = psutil.Process(_stats(server)["dp_engine_pids"][0])

    async def run() -> None:
        long = [asyncio.create_task(client.completions.create(
            model=MODEL, prompt=_prompt_ids(16, 100 + s), max_tokens=480,
            extra_body={"data_parallel_rank": 0, "ignore_eos": True})) for s in range(6)]
        await asyncio.to_thread(wait_until, lambda: _stats(server)["dp_published_counts"][0]
                                == [4, 2], 60, "rank 0's queue published")
        rank0.suspend()
        try:
            short = [client.completions.create(model=MODEL, prompt=_prompt_ids(8, s),
                                               max_tokens=2) for s in range(4)]
            await asyncio.gather(*short)
        finally:
            rank0.resume()
        after_short = _samples(server, FINISHED)
        assert after_short["1"] - before.get("1", 0) == 4
        await asyncio.gather(*long)

    asyncio.run(run())
    after = _samples(server, FINISHED)
    assert after["0"] - before.get("0", 0) == 6
    assert after["1"] - before.get("1", 0) == 4


def test_outputs_equal_single_engine_greedy(server, tiny_model):
    from engine import LLM, SamplingParams

    prompts = [_prompt_ids(n, n) for n in (3, 17, 40, 64)]
    llm = LLM(tiny_model, multiprocess=False, num_kv_blocks=256, max_model_len=512)
    try:
        ref = [o.outputs[0].text for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)]
    finally:
        llm.shutdown()
    client = _client(server, openai.AsyncOpenAI)

    async def one(p: list[int], rank: int | None) -> str:
        extra = {"ignore_eos": True, **({} if rank is None else {"data_parallel_rank": rank})}
        r = await client.completions.create(model=MODEL, prompt=p, max_tokens=12,
                                            temperature=0, extra_body=extra)
        return r.choices[0].text

    async def run() -> list[str]:
        jobs = [one(p, rank) for p in prompts for rank in (None, 0, 1)]
        return await asyncio.gather(*jobs)

    texts = asyncio.run(run())
    for i, text in enumerate(ref):
        assert texts[3 * i:3 * i + 3] == [text] * 3


def test_n_greater_than_one_and_aborts_reach_their_engines(server):
    client = _client(server)
    r = client.completions.create(model=MODEL, prompt=[4, 5, 6], max_tokens=5, n=3,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert len(r.choices) == 3 and len({c.text for c in r.choices}) == 1
    wait_until(lambda: _idle(server), 30, "idle after n=3")
    # Streams (n=2, unpinned: the children may land on both ranks; and pinned to rank 1)
    # closed early: their aborts must reach whichever engine holds each child.
    for extra in ({}, {"data_parallel_rank": 1}):
        steps = _steps(server)
        stream = client.completions.create(
            model=MODEL, prompt=_prompt_ids(50), max_tokens=400, n=2, stream=True,
            extra_body={"ignore_eos": True, **extra})
        engines = [psutil.Process(pid) for pid in _stats(server)["dp_engine_pids"]]
        port = stream.response.extensions["network_stream"].get_extra_info(
            "socket").getsockname()[1]
        for seen, _ in enumerate(stream):
            if seen == 5:
                break
        # Held from before the close until the server dropped the stream (its aborts are on
        # their way): the engines cannot decode on while a slow server notices.
        for e in engines:
            e.suspend()
        try:
            stream.close()
            wait_until(lambda port=port: not _holds_connection(server, port), 30,
                       "the server to drop the stream")
        finally:
            for e in engines:
                e.resume()
        wait_until(lambda: _idle(server), 30, f"aborted requests gone from the engines {extra}")
        ran = [b - a for a, b in zip(steps, _steps(server), strict=True)]
        assert max(ran) < 300, ran  # aborted: no engine ran the 400 decode steps
        if extra:
            assert ran[1] > 0 and ran[0] == 0, ran  # pinned: only rank 1 worked


def _holds_connection(server: ServerProcess, client_port: int) -> bool:
    return any(c.raddr and c.raddr.port == client_port
               for c in psutil.Process(server.pid).net_connections(kind="tcp"))


def _steps(server: ServerProcess) -> list[int]:
    engines = _stats(server)["engines"]
    return [engines[r]["num_steps"] for r in ("0", "1")]


def test_external_lb_server_runs_one_rank(servers):
    ext = servers["ext"]
    client = _client(ext)
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                  extra_body={"data_parallel_rank": 1})
    assert r.choices[0].text is not None
    assert set(_samples(ext, "pdserve:generation_tokens_total")) == {"1"}
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1,
                                  extra_body={"data_parallel_rank": 0})
    assert "data_parallel_rank" in str(exc.value)
    assert "engines" not in _stats(ext)  # one plain engine, no coordinator


def test_engine_death_fails_its_requests_and_the_others_keep_serving(servers):
    """Policy: a dead rank's requests fail at once; the other ranks keep serving; a request
    pinned to the dead rank gets 503; /health stays 200 while one engine lives."""
    srv = servers["death"]
    client = _client(srv)
    pid = _stats(srv)["dp_engine_pids"][1]
    stream = client.completions.create(model=MODEL, prompt=[7, 8, 9], max_tokens=450,
                                       stream=True,
                                       extra_body={"data_parallel_rank": 1, "ignore_eos": True})
    next(iter(stream))
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(openai.APIError) as exc:
        for _ in stream:
            pass
    assert "data-parallel engine 1 died" in str(exc.value)
    wait_until(lambda: _stats(srv)["dead_engines"] == [1], 10, "rank 1 reported dead")
    for _ in range(3):
        r = client.completions.create(model=MODEL, prompt="still here", max_tokens=2)
        assert r.choices[0].finish_reason == "length"
    with pytest.raises(openai.APIStatusError) as exc:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1,
                                  extra_body={"data_parallel_rank": 1})
    assert exc.value.status_code == 503
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    # The coordinator dies too: balancing falls back to the server's own counts.
    os.kill(_stats(srv)["dp_coordinator_pid"], signal.SIGKILL)
    wait_until(lambda: not _stats(srv)["dp_coordinator_alive"], 10, "coordinator death seen")
    r = client.completions.create(model=MODEL, prompt="no coordinator", max_tokens=2)
    assert r.choices[0].finish_reason == "length"
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize(("flags", "who"), [
    (("--data-parallel-size", "2"), "data-parallel rank 1"),
    (("--tensor-parallel-size", "2"), "tensor-parallel rank 1"),
], ids=["dp", "tp"])
def test_a_taken_side_channel_port_of_a_rank_is_a_clear_error_at_start(tiny_model, flags, who):
    """Rank 1 serves its side channel at --kv-port + 1: taken, the server refuses to start,
    naming the port and the rank, before any engine process exists."""
    import socket
    import subprocess
    import sys

    from engine.net import free_port

    base = free_port(count=2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 1))
        taken.listen()
        r = subprocess.run([sys.executable, "-m", "pdserve.cli", "prefill", tiny_model,
                            "--port", str(free_port()), "--kv-port", str(base), *flags,
                            "--kv-connector", "NixlPushConnector", "--engine-id", "P0"],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"{who}: KV side-channel port {base + 1} on 127.0.0.1 cannot be bound" in r.stderr
    assert "Traceback" not in r.stderr
