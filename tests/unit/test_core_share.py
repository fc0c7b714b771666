"""engine/threads.py CoreShare: model processes on one node count each other and size their
intra-op pools to their share of the cores (issue 33 item 6)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.threads import (
    PACE_ENV,
    PACE_MS,
    REGISTRY_ENV,
    SHARE_ENV,
    CoreShare,
    DecodePace,
    apply_thread_defaults,
    core_share,
    shared_cores,
)

HOLDER = """
import sys, time
from engine.threads import CoreShare
share = CoreShare(2, directory=sys.argv[1], cpus=frozenset({0, 1}))
print("registered", flush=True)
time.sleep(600)
"""


def _clock():
    now = [0.0]
    return now, lambda: now[0]


def test_an_engine_alone_keeps_its_threads_and_halves_them_when_another_arrives(
        tmp_path) -> None:
    got: list[int] = []
    now, clock = _clock()
    first = CoreShare(2, directory=str(tmp_path), cpus=frozenset({0, 1}),
                      set_threads=got.append, clock=clock)
    assert first.tick() is None and first.threads == 2  # alone: what torch chose
    second = CoreShare(2, directory=str(tmp_path), cpus=frozenset({0, 1}), clock=clock)
    assert first.tick() is None  # not due yet: one recount a second at most
    now[0] += first.recount_s
    assert first.tick() == 1 and got == [1]
    assert second.tick() == 1
    second.close()
    now[0] += first.recount_s
    assert first.tick() == 2 and got == [1, 2]  # the other left: the threads come back
    first.close()
    assert os.listdir(tmp_path) == []


def test_engines_on_other_cores_do_not_count(tmp_path) -> None:
    mine = CoreShare(2, directory=str(tmp_path), cpus=frozenset({0, 1}))
    CoreShare(2, directory=str(tmp_path), cpus=frozenset({2, 3}))
    assert mine.sharing() == 1 and mine.tick() is None and mine.threads == 2
    CoreShare(4, directory=str(tmp_path), cpus=frozenset({1, 2}))
    assert mine.sharing() == 2 and mine.fair() == 1


def test_never_more_threads_than_torch_chose_nor_fewer_than_one(tmp_path) -> None:
    one = CoreShare(1, directory=str(tmp_path), cpus=frozenset(range(8)))
    assert one.tick() is None and one.threads == 1
    for _ in range(9):
        CoreShare(8, directory=str(tmp_path), cpus=frozenset(range(8)))
    assert one.fair() == 1
    wide = CoreShare(8, directory=str(tmp_path), cpus=frozenset(range(8)))
    assert wide.fair() == 1


def test_a_dead_engines_entry_is_removed_and_no_longer_counts(tmp_path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        assert holder.stdout.readline().strip() == "registered"
        mine = CoreShare(2, directory=str(tmp_path), cpus=frozenset({0, 1}))
        assert mine.sharing() == 2
        holder.kill()  # no clean-up: only its lock goes with it
        holder.wait(10)
        assert mine.sharing() == 1
        assert os.listdir(tmp_path) == [mine.name]
    finally:
        holder.kill()
        holder.wait(10)


def test_a_registry_another_user_could_write_is_refused(tmp_path) -> None:
    shared = tmp_path / "open"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match="not a 0700 directory"):
        CoreShare(2, directory=str(shared), cpus=frozenset({0, 1}))
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(PermissionError):
        CoreShare(2, directory=str(tmp_path / "link"), cpus=frozenset({0, 1}))


def test_an_unlocked_entry_is_taken_for_a_dead_one(tmp_path) -> None:
    mine = CoreShare(2, directory=str(tmp_path), cpus=frozenset({0, 1}))
    (tmp_path / "junk").write_text("0,1")  # nobody holds its lock
    assert mine.sharing() == 1 and not (tmp_path / "junk").exists()


def test_the_server_turns_sharing_on_unless_the_user_chose() -> None:
    env: dict[str, str] = {}
    assert apply_thread_defaults(env)[SHARE_ENV] == "1"
    env = {SHARE_ENV: "0"}
    assert SHARE_ENV not in apply_thread_defaults(env) and env[SHARE_ENV] == "0"


SERVER_PROCESS = """
import torch
from engine.threads import core_share
torch.set_num_threads(2)
share = core_share(torch.get_num_threads())
share.tick()
print(torch.get_num_threads(), flush=True)
"""


def test_a_server_model_process_narrows_torchs_pool(tmp_path) -> None:
    """The runner's path: core_share + tick on the model's thread change torch's own count
    when a second model process is registered on the same two CPUs."""
    if not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip("needs CPUs 0 and 1")
    other = CoreShare(2, directory=str(tmp_path), cpus=frozenset({0, 1}))
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update({SHARE_ENV: "1", REGISTRY_ENV: str(tmp_path)})
    out = subprocess.run(
        ["taskset", "-c", "0,1", sys.executable, "-c", SERVER_PROCESS], env=env,
        capture_output=True, text=True, timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "1"
    other.close()


def test_the_users_thread_count_stands_and_opting_out_registers_nothing(
        tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(REGISTRY_ENV, str(tmp_path))
    monkeypatch.setenv(SHARE_ENV, "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    fixed = core_share(2)
    assert fixed is not None and fixed._set is None  # counted by the others, never narrowed
    assert os.listdir(tmp_path) == [fixed.name]
    fixed.close()
    monkeypatch.setenv(SHARE_ENV, "0")
    assert core_share(2) is None and os.listdir(tmp_path) == []
    monkeypatch.delenv(SHARE_ENV)
    assert core_share(2) is None  # an offline LLM: no server set it


# --- DecodePace: decode steps held for KV about to land, on shared cores -----------------


class _Sleeps:
    def __init__(self, now: list[float]) -> None:
        self.now, self.slept = now, []

    def __call__(self, s: float) -> None:
        self.slept.append(round(s, 6))
        self.now[0] += s


@pytest.mark.parametrize("shared,holds,held", [(True, True, True), (False, True, False),
                                              (True, False, False)])
def test_decode_steps_are_held_only_on_shared_cores_while_kv_is_about_to_land(
        shared, holds, held) -> None:
    now, clock = _clock()
    sleep = _Sleeps(now)
    pace = DecodePace(0.06, shared=lambda: shared, clock=clock, sleep=sleep)
    assert pace.wait(holds) == 0.0  # the first step: nothing to space it from
    now[0] += 0.01  # a 10 ms step
    assert pace.wait(holds) == pytest.approx(0.05 if held else 0.0)
    assert sleep.slept == ([0.05] if held else [])
    now[0] += 0.08  # a step longer than the interval is never held
    assert pace.wait(holds) == 0.0 and len(sleep.slept) == (1 if held else 0)


def test_pace_follows_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(PACE_ENV, "0")
    now, clock = _clock()
    assert DecodePace(shared=lambda: True, clock=clock).wait(True) == 0.0
    assert DecodePace(shared=lambda: True, clock=clock).interval_s == 0.0
    monkeypatch.setenv(PACE_ENV, "25")
    assert DecodePace().interval_s == 0.025
    monkeypatch.setenv(PACE_ENV, "soon")
    assert DecodePace().interval_s == PACE_MS / 1e3


def test_shared_cores_is_what_this_process_last_counted(tmp_path) -> None:
    import gc

    gc.collect()  # earlier tests' registrations, unclosed, are gone
    now, clock = _clock()
    mine = CoreShare(2, directory=str(tmp_path), cpus=frozenset({0, 1}), clock=clock)
    assert not shared_cores()
    other = CoreShare(2, directory=str(tmp_path), cpus=frozenset({0, 1}), clock=clock)
    assert mine.tick() == 1 and shared_cores()
    other.close()
    now[0] += mine.recount_s
    assert mine.tick() == 2 and not shared_cores()
    mine.close()
    assert not shared_cores()


def _d_scheduler():
    from types import SimpleNamespace

    from engine.connector_api import KVCacheSpec
    from engine.kv_transfer_config import KVTransferConfig
    from engine.sched.scheduler import Scheduler
    from kvconnector.pull.scheduler import PullScheduler

    kv = KVTransferConfig(kv_connector="NixlConnector", engine_id="D0", kv_port=7002)
    spec = KVCacheSpec(num_blocks=64, block_size=4, num_layers=1, num_kv_heads=1, head_dim=4,
                       dtype="float32", bytes_per_block=64, model_name="m")
    conn = PullScheduler(SimpleNamespace(kv_transfer_config=kv), spec)
    return Scheduler(block_size=4, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64,
                     max_model_len=256, connector=conn)


def _run(sched, finished_recving=()):
    from engine.connector_api import KVConnectorOutput
    from engine.runner_output import ModelRunnerOutput

    so = sched.schedule()
    ids = list(so.num_scheduled_tokens)
    out = ModelRunnerOutput(
        req_ids=ids, sampled_token_ids=[[5] for _ in ids], logprobs=[None] * len(ids),
        kv_connector_output=KVConnectorOutput(finished_recving=set(finished_recving)))
    sched.update_from_output(so, out)


def test_the_scheduler_says_when_a_decode_step_awaits_kv() -> None:
    import time

    from engine.protocol import SamplingParams
    from engine.sched.request import Request
    from kvconnector.endpoint import Endpoint
    from kvconnector.pull.meta import prompt_digest
    from kvconnector.pull.params import prefill_answer

    sched = _d_scheduler()
    prompt = list(range(100, 110))

    def answer(rid: str) -> dict:  # P's answer for a finished prefill, as the proxy passes it
        return prefill_answer(Endpoint("P0", "127.0.0.1", 7001), rid, [0, 1, 2], len(prompt),
                              prompt_digest(prompt), time.time() + 100, "t-" + rid)

    def add(rid: str, kv: dict | None) -> None:
        sched.add_request(Request(rid, prompt,
                                  SamplingParams(temperature=0.0, max_tokens=20), None,
                                  kv_transfer_params=kv))

    add("d1", answer("p-1"))
    add("d2", answer("p-2"))
    _run(sched)  # both wait for their KV
    assert not sched.decode_awaits_kv()  # nothing runs: the parked loop's case, not this one
    _run(sched, {"d1"})
    _run(sched)
    assert "d1" in {r.request_id for r in sched.running}
    assert sched.decode_awaits_kv()  # d1 decodes while d2's KV is on its way
    add("local", None)  # a prompt to prefill here: never held
    assert not sched.decode_awaits_kv()
