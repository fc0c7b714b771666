"""EngineCoreProc + SyncMPClient: a real spawned core process, real ZeroMQ sockets."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from engine.client import make_client
from engine.client.base import EngineDeadError
from engine.client.inproc import InprocClient
from engine.client.mp_client import SyncMPClient, UtilityCallError
from engine.config import EngineConfig
from engine.core.busy_loop import EngineCoreLoop, InputKind
from engine.core.engine_core import EngineCore
from engine.core.messages import engine_identity
from engine.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    SamplingParams,
)

NUM_BLOCKS = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def config(tiny_model: str) -> EngineConfig:
    return EngineConfig(model=tiny_model, num_kv_blocks=NUM_BLOCKS, max_model_len=256)


@pytest.fixture(scope="module")
def client(config: EngineConfig):
    c = make_client(config, multiprocess=True, asyncio_mode=False, utility_timeout_s=30)
    assert isinstance(c, SyncMPClient)
    yield c
    c.shutdown()


def req(rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> EngineCoreRequest:
    return EngineCoreRequest(rid, prompt, params, eos_token_id=None)


def collect(client, ids: set[str], timeout: float = 30.0) -> tuple[dict, dict, list]:
    """Run until every id finished: (tokens by id, finish output by id, batches seen)."""
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    finals: dict = {}
    batches: list[EngineCoreOutputs] = []
    deadline = time.monotonic() + timeout
    while set(finals) != ids:
        assert time.monotonic() < deadline, f"unfinished: {ids - set(finals)}"
        out = (client.get_output(timeout=timeout) if isinstance(client, SyncMPClient)
               else client.get_output())
        batches.append(out)
        for o in out.outputs:
            if o.request_id in ids:
                tokens[o.request_id].extend(o.new_token_ids)
                if o.finished:
                    finals[o.request_id] = o
    return tokens, finals, batches


def assert_idle(client, timeout: float = 10.0) -> dict:
    """No request left anywhere in the core and every block free (the model runner forgets
    an aborted request on the step after the abort, so allow a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = client.call_utility("get_stats")
        if stats["num_runner_requests"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert stats["num_unfinished_requests"] == 0
    assert stats["num_runner_requests"] == 0
    assert stats["num_free_blocks"] == stats["num_kv_blocks"] == NUM_BLOCKS
    return stats


def live_children() -> list[psutil.Process]:
    """Our child processes, minus multiprocessing's own resource tracker."""
    kids = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(
                    p.cmdline()):
                kids.append(p)
        except psutil.NoSuchProcess:
            continue
    return kids


def test_handshake_reports_kv_blocks_and_max_model_len(client):
    assert client.num_kv_blocks == NUM_BLOCKS
    assert client.max_model_len == 256
    assert client.supported_tasks == ["generate"]
    proc = psutil.Process(client.core.pid)
    assert proc.is_running() and proc.ppid() == os.getpid()


def test_greedy_round_trip_matches_in_process_core(client, config):
    prompts = {"a": [1, 5, 9, 13, 17], "b": [3, 1, 4, 1, 5, 9, 2, 6]}
    for rid, p in prompts.items():
        client.add_request(req(rid, p))
    tokens, finals, _ = collect(client, set(prompts))
    assert all(f.finish_reason == FinishReason.LENGTH for f in finals.values())
    inproc = InprocClient(config)
    try:
        for rid, p in prompts.items():
            inproc.add_request(req(rid, p))
        expected, _, _ = collect(inproc, set(prompts))
    finally:
        inproc.shutdown()
    assert tokens == expected
    assert all(len(t) == GREEDY.max_tokens for t in tokens.values())
    assert_idle(client)


def test_adds_arriving_during_a_step_are_coalesced_into_one_batch(config):
    """The busy loop drains every input queued during a step before the next step. The loop
    runs in process with its step held until all four adds are queued: over ZeroMQ their
    arrival would race the tiny model's millisecond steps (the transport has its own tests)."""
    loop = EngineCoreLoop(EngineCore(config))
    real_step, in_step, release = loop.core.step, threading.Event(), threading.Event()

    def held_step():
        if not in_step.is_set():
            in_step.set()
            assert release.wait(30)
        return real_step()

    loop.core.step = held_step
    runner = threading.Thread(target=loop.run, daemon=True)
    runner.start()
    late = {f"late{i}" for i in range(4)}
    long = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    try:
        loop.input_queue.put((InputKind.ADD, req("busy", [7, 7, 7], long)))
        assert in_step.wait(30)  # the loop is inside the step that runs "busy"
        for rid in sorted(late):
            loop.input_queue.put((InputKind.ADD, req(rid, [2, 4, 6, 8])))
        release.set()
        batches, finished = [], set()
        while finished != late | {"busy"}:
            out = loop.output_queue.get(timeout=30)
            batches.append(out)
            finished |= {o.request_id for o in out.outputs if o.finished}
    finally:
        release.set()
        loop.request_shutdown()
        runner.join(30)
        loop.core.shutdown()
    assert not runner.is_alive()
    assert [o.request_id for o in batches[0].outputs] == ["busy"]
    first_seen = [next(i for i, b in enumerate(batches)
                       if any(o.request_id == rid for o in b.outputs)) for rid in late]
    assert first_seen == [1] * 4, "late adds were not scheduled in one step"
    tokens = {r: [t for b in batches for o in b.outputs if o.request_id == r
                  for t in o.new_token_ids] for r in late}
    assert len({tuple(t) for t in tokens.values()}) == 1  # same prompt, greedy → same tokens


def test_abort_stops_the_request_and_frees_its_blocks(client):
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    client.add_request(req("victim", list(range(1, 40)), long))
    client.add_request(req("bystander", [1, 2, 3]))
    out = client.get_output(timeout=30)
    assert any(o.request_id == "victim" for o in out.outputs)
    client.abort_requests(["victim"])
    tokens, finals, _ = collect(client, {"bystander"})
    assert finals["bystander"].finish_reason == FinishReason.LENGTH
    assert_idle(client)  # no unfinished requests, every block back


def test_utility_calls(client):
    stats = client.call_utility("get_stats")
    assert {"num_kv_blocks", "num_free_blocks", "num_steps", "num_malformed_inputs"} <= set(stats)
    assert client.call_utility("reset_prefix_cache") is True
    assert client.call_utility("get_supported_tasks") == ["generate"]
    with pytest.raises(UtilityCallError, match="unknown utility method"):
        client.call_utility("shutdown")


def test_rejected_add_gets_an_error_output_not_a_dead_engine(client):
    long = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    client.add_request(req("dup", [1, 2, 3], long))
    client.add_request(req("dup", [1, 2, 3], long))
    errors, done = [], False
    while not done:
        for o in client.get_output(timeout=30).outputs:
            if o.finish_reason == FinishReason.ERROR:
                errors.append(o)
            elif o.finished:
                done = True
    assert len(errors) == 1 and "already running" in errors[0].error
    assert_idle(client)


def test_malformed_input_messages_are_counted_dropped_and_serving_continues(client):
    before = client.call_utility("get_stats")["num_malformed_inputs"]
    ident = engine_identity(0)
    add = EngineCoreRequestType.ADD.value
    bad = [
        [ident, add, b"\xc1\xc1\xc1"],  # not msgpack
        [ident, add, b"\x93\x01\x02\x03"],  # msgpack, not an EngineCoreRequest
        [ident, add],  # no body
        [ident, b"\x7f", b"\x90"],  # unknown request type
        [ident, EngineCoreRequestType.ABORT.value, b"\x91\x05"],  # ids must be strings
    ]
    for frames in bad:
        client.core.input_socket.send_multipart(frames)
    client.add_request(req("after-garbage", [4, 5, 6]))
    tokens, finals, _ = collect(client, {"after-garbage"})
    assert len(tokens["after-garbage"]) == GREEDY.max_tokens
    stats = assert_idle(client)
    assert stats["num_malformed_inputs"] - before == len(bad)


def test_fatal_error_in_the_core_sends_engine_core_dead(config):
    c = SyncMPClient(config)
    try:
        # Token id far outside the vocabulary: the raw client skips input validation, the
        # model's embedding lookup raises inside step() -> fatal for the core.
        c.add_request(req("poison", [1, 2, 10**6]))
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="ENGINE_CORE_DEAD|exited"):
            c.get_output(timeout=30)
        assert time.monotonic() - t0 < 10
        with pytest.raises(EngineDeadError):
            c.add_request(req("later", [1, 2]))
        with pytest.raises(EngineDeadError):
            c.call_utility("get_stats")
        c.core.proc.join(10)
        assert c.core.exitcode == 1
    finally:
        c.shutdown()


def test_sigkill_of_the_core_fails_every_waiter_within_two_seconds(config):
    c = SyncMPClient(config)
    pid = c.core.pid
    try:
        os.kill(pid, signal.SIGSTOP)  # utility calls now wait for an answer that never comes
        results: dict[str, BaseException | None] = {}

        def wait(name, fn):
            try:
                fn()
                results[name] = None
            except BaseException as e:  # noqa: BLE001 - recorded for the assertion
                results[name] = e

        threads = [
            threading.Thread(target=wait, args=("output", lambda: c.get_output(timeout=20))),
            threading.Thread(target=wait, args=("utility", lambda: c.call_utility("get_stats"))),
        ]
        for t in threads:
            t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        for t in threads:
            t.join(5)
        assert time.monotonic() - t0 < 2.0
        assert all(isinstance(results.get(k), EngineDeadError) for k in ("output", "utility")), \
            results
        t1 = time.monotonic()
        with pytest.raises(EngineDeadError):
            c.add_request(req("late", [1]))
        with pytest.raises(EngineDeadError):
            c.get_output()
        assert time.monotonic() - t1 < 0.5
    finally:
        c.shutdown()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_sigterm_drains_in_flight_requests_then_exits_over_tcp(config):
    c = SyncMPClient(config, use_tcp=True)
    assert c.core.output_socket.getsockopt_string(32).startswith("tcp://")  # LAST_ENDPOINT
    pid = c.core.pid
    try:
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        c.add_request(req("inflight", [1, 2, 3, 4], params))
        tokens = list(c.get_output(timeout=30).outputs[0].new_token_ids)
        os.kill(pid, signal.SIGTERM)
        finished = None
        refused = None
        sent_late = False
        while finished is None or refused is None:
            try:
                out = c.get_output(timeout=30)
            except EngineDeadError:
                break
            for o in out.outputs:
                if o.request_id == "inflight":
                    tokens += o.new_token_ids
                    finished = o if o.finished else None
                elif o.request_id == "too-late":
                    refused = o
            if not sent_late:
                sent_late = True  # the engine has seen SIGTERM by its next output
                c.add_request(req("too-late", [5, 6]))
        assert finished is not None and finished.finish_reason == FinishReason.LENGTH
        assert len(tokens) == 10
        assert refused is not None and refused.finish_reason == FinishReason.ERROR
        assert "shutting down" in refused.error
        c.core.proc.join(15)
        assert c.core.exitcode == 0
        with pytest.raises(EngineDeadError):
            c.get_output(timeout=5)
    finally:
        c.shutdown()


def test_startup_failure_is_reported_with_its_cause_and_leaves_nothing_behind(tmp_path):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"]}')
    before = {p.pid for p in live_children()}
    with pytest.raises(RuntimeError, match="failed to start: .*NoSuchForCausalLM"):
        SyncMPClient(EngineConfig(model=str(broken), num_kv_blocks=16))
    assert {p.pid for p in live_children()} <= before


def test_core_exits_when_its_parent_process_dies(config, tmp_path):
    script = tmp_path / "frontend.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        from engine.config import EngineConfig
        from engine.client.mp_client import SyncMPClient
        if __name__ == "__main__":
            cfg = EngineConfig(model=sys.argv[1], num_kv_blocks=16, max_model_len=128)
            client = SyncMPClient(cfg)
            print(client.core.pid, flush=True)
            time.sleep(300)
    """))
    frontend = subprocess.Popen([sys.executable, str(script), config.model],
                                stdout=subprocess.PIPE, text=True)
    try:
        engine_pid = int(frontend.stdout.readline())
        engine = psutil.Process(engine_pid)
        assert engine.ppid() == frontend.pid
        frontend.kill()  # no cleanup code runs in the frontend
        frontend.wait(10)
        deadline = time.monotonic() + 5
        while engine.is_running() and engine.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "engine core outlived its parent"
            time.sleep(0.1)
    finally:
        frontend.kill()
        frontend.stdout.close()


def test_shutdown_leaves_no_process_socket_or_ipc_file(client):
    """Runs last: shuts the module's shared client down."""
    pid = client.core.pid
    ipc_dir = client.core._ipc_dir
    assert ipc_dir and os.listdir(ipc_dir)
    client.add_request(req("x", [1, 2, 3]))
    collect(client, {"x"})
    t0 = time.monotonic()
    client.shutdown()
    assert time.monotonic() - t0 < 6
    assert not os.path.exists(ipc_dir)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert pid not in [p.pid for p in live_children()]
    with pytest.raises(EngineDeadError):
        client.add_request(req("y", [1]))
    with pytest.raises(EngineDeadError):
        client.get_output(timeout=1)
    client.shutdown()  # idempotent
