"""engine/threads.py CoreShare: model processes on one node count each other and size their
intra-op pools to their share of the cores (issue 33 item 6)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.threads import REGISTRY_ENV, SHARE_ENV, CoreShare, apply_thread_defaults, core_share

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
