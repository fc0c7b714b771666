"""The TP ranks' shared-memory all-reduce / all-gather (engine/executor/shm_collectives.py,
engine/kernels/shm_comm.cpp), in two real processes: bit-equal to gloo on every shape and
dtype the TP layers use, identical on both ranks; a dead or absent peer makes the waiting
rank raise (never spin forever); the segment is private and leaves no name behind.

The ranks are this file run as a script (`_rank_main`)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time

import pytest
from pd_harness import wait_until

# (op, shape, dtype): decode and prefill sizes of the TP layers' activations (hidden 512 /
# the tiny model's 64), the logits' all-gather, odd sizes, and sizes above one 2 MiB slot.
CASES = [(op, shape, dt) for dt in ("float32", "bfloat16") for op, shape in (
    ("reduce", [1, 512]), ("reduce", [64, 512]), ("reduce", [1024, 512]),
    ("reduce", [2048, 512]), ("reduce", [4096, 512]), ("reduce", [3, 65]),
    ("reduce", [7, 64]), ("gather", [1, 4096]), ("gather", [64, 4096]),
    ("gather", [300, 4096]), ("gather", [5, 33]), ("gather", [0, 16]))]


def _rank_main(mode: str, rank: int, path: str, out: str, arg: str) -> None:
    import hashlib

    import torch

    from engine.kernels.shm_comm import compiled_shm

    if mode != "equal":  # "dead" / "absent": the raw kernel, rank 1 never arrives
        comm = compiled_shm().ShmComm(path, rank, 2, 2 << 20, float(arg))
        with open(out + ".ready", "w"):
            pass
        if rank == 1:
            signal.pause()
        t0, cpu0, woke0 = time.monotonic(), time.process_time(), _woke()
        try:
            comm.all_reduce(torch.ones(1024))
            result = {"raised": None}
        except RuntimeError as e:
            result = {"raised": str(e)}
        result["waited_s"] = time.monotonic() - t0
        result["cpu_s"] = time.process_time() - cpu0
        result["wakes"] = _woke() - woke0
        with open(out, "w") as f:
            json.dump(result, f)
        return
    import torch.distributed as dist

    from engine.executor.shm_collectives import GLOO, make_collectives

    dist.init_process_group("gloo", store=dist.FileStore(arg, 2), rank=rank, world_size=2)
    comm, kind = make_collectives(path, rank, 2, 60.0)
    results = []
    for i, (op, shape, dt) in enumerate(CASES):
        gen = torch.Generator().manual_seed(1000 * i + rank)
        x = torch.randn(shape, generator=gen).to(getattr(torch, dt))
        if op == "reduce":
            want, got = GLOO.all_reduce(x.clone()), comm.all_reduce(x.clone())
        else:
            want, got = GLOO.all_gather(x.clone()), comm.all_gather(x.clone())
        results.append({"equal": bool(torch.equal(want, got)) and want.dtype == got.dtype,
                        "sha": hashlib.sha256(got.contiguous().view(torch.uint8)
                                              .numpy().tobytes()).hexdigest()})
    # A dtype the segment does not take goes through gloo, still summed.
    other = torch.full((8, 16), float(rank + 1), dtype=torch.float64)
    results.append({"equal": bool((comm.all_reduce(other) == 3.0).all()), "sha": ""})
    for name, full in _argmax_cases(torch):
        got = _gather_argmax(torch, full, rank, comm)
        results.append({"equal": bool(torch.equal(got, full.argmax(dim=-1))),
                        "sha": str(got.tolist()), "case": name})
    with open(out, "w") as f:
        json.dump({"kind": kind, "results": results}, f)
    dist.destroy_process_group()


def _argmax_cases(torch):
    """Full logits [N, V] (the same on both ranks) for greedy decoding's sharded argmax."""
    gen = torch.Generator().manual_seed(5)
    odd = torch.randn(64, 8191, generator=gen)  # odd: rank 1's shard has a padding column
    yield "random, padded shard", odd
    ties = torch.zeros(4, 100)
    ties[0, [10, 60]] = 1.0  # the same maximum on both ranks: rank 0's
    ties[1, [60, 70]] = 1.0  # twice on rank 1: its first
    ties[2, :] = float("-inf")  # nothing but -inf: index 0
    ties[3, 99] = 2.0  # the last column
    yield "ties across ranks", ties
    nan = torch.randn(3, 100, generator=gen)
    nan[0, 70] = float("nan")  # only rank 1 has one
    nan[1, [20, 80]] = float("nan")  # both: rank 0's
    nan[2, [90, 95]] = float("nan")  # rank 1's first
    yield "NaN", nan


def _gather_argmax(torch, full, rank: int, comm):
    """Rank `rank`'s shard of `full` as the TP lm_head leaves it (padding columns of +inf,
    which must never win), then gather_argmax."""
    from engine.models.parallel import TPLayout, gather_argmax

    n, vocab = full.shape
    rows = -(-vocab // 2)
    padded = torch.cat([full, torch.full((n, 2 * rows - vocab), float("inf"))], dim=1)
    layout = TPLayout(rank, 2, 1, 1, 0, 1, rank * rows, rows, vocab)
    return gather_argmax(padded[:, rank * rows:(rank + 1) * rows].contiguous(), layout,
                         comm)


def _woke() -> int:
    """How often this thread blocked and was woken (Linux: voluntary context switches)."""
    with open(f"/proc/self/task/{threading.get_native_id()}/status") as f:
        return next(int(line.split()[1]) for line in f
                    if line.startswith("voluntary_ctxt_switches:"))


def _spawn(mode: str, rank: int, path: str, out: str, arg: str) -> subprocess.Popen:
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # pd_harness
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), tests])}
    return subprocess.Popen([sys.executable, __file__, mode, str(rank), path, out, arg],
                            env=env)


@pytest.fixture
def segment(tmp_path):
    from engine.executor.shm_collectives import create_segment, remove_segment

    path = create_segment(str(tmp_path), 2)
    assert path is not None
    yield path
    remove_segment(path)


def test_segment_is_private_reserved_and_removable(segment, tmp_path):
    from engine.executor.shm_collectives import remove_segment, segment_bytes

    st = os.stat(segment)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
    assert st.st_size == segment_bytes(2)
    assert st.st_blocks * 512 >= segment_bytes(2)  # reserved: a full tmpfs fails here, not later
    remove_segment(segment)
    assert not os.path.exists(segment)


def test_shm_all_reduce_and_all_gather_equal_gloo_bit_for_bit_on_both_ranks(segment, tmp_path):
    """And greedy decoding's argmax over the ranks' logit shards (`gather_argmax`) is
    torch.argmax of the whole logits on both ranks: ties to the first, NaN, padding."""
    import torch

    outs = [str(tmp_path / f"rank{r}.json") for r in (0, 1)]
    procs = [_spawn("equal", r, segment, outs[r], str(tmp_path / "store")) for r in (0, 1)]
    assert [p.wait(timeout=240) for p in procs] == [0, 0]
    got = [json.load(open(o)) for o in outs]
    assert [g["kind"] for g in got] == ["shm", "shm"]
    cases = [*CASES, "float64 via gloo", *(name for name, _ in _argmax_cases(torch))]
    for case, a, b in zip(cases, *(g["results"] for g in got), strict=True):
        assert a["equal"] and b["equal"], case  # each rank: shm == gloo
        assert a["sha"] == b["sha"], case  # and both ranks hold the same bytes


@pytest.mark.parametrize("mode", ["dead", "absent"])
def test_waiting_rank_raises_when_its_peer_is_dead_or_never_arrives(mode, segment, tmp_path):
    """dead: rank 1 is SIGKILLed while rank 0 waits (deadline 120 s): rank 0 raises within
    seconds naming the gone peer. absent: rank 1 lives but never arrives (deadline 1 s), and
    rank 0 sleeps on the futex meanwhile (woken by its 10 ms checks, not polling): at most
    200 wake-ups a second and 10 % of a core, where the sched_yield and 50 us sleeps of the
    old wait woke it ~10 000 times a second."""
    outs = [str(tmp_path / f"rank{r}.json") for r in (0, 1)]
    deadline = "120" if mode == "dead" else "1"
    procs = [_spawn(mode, r, segment, outs[r], deadline) for r in (1, 0)]
    try:
        wait_until(lambda: all(os.path.exists(o + ".ready") for o in outs), timeout=120,
                   what="both ranks mapped the segment")
        if mode == "dead":
            procs[0].send_signal(signal.SIGKILL)
            procs[0].wait(timeout=30)
        killed = time.monotonic()
        assert procs[1].wait(timeout=60) == 0
        waited = time.monotonic() - killed
        result = json.load(open(outs[0]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if mode == "dead":
        assert "tensor-parallel rank 1" in result["raised"] and "is gone" in result["raised"]
        assert waited < 10, waited
    else:
        assert "did not reach collective round 1 within 1s" in result["raised"]
        assert 1.0 <= result["waited_s"] < 10, result
        assert result["wakes"] <= 200 * result["waited_s"], result
        assert result["cpu_s"] <= 0.1 * result["waited_s"], result


def test_tp2_engine_runs_on_the_shared_segment_and_leaves_no_name(tiny_model):
    """Both ranks of a TP=2 engine report the shared-memory path; the segment's name is gone
    once they are ready (each holds its mapping), and TP=2 greedy equals TP=1 on it."""
    from engine import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tp2 = LLM(tiny_model, num_kv_blocks=64, multiprocess=False, tensor_parallel_size=2)
    try:
        executor = tp2.engine.client.core.executor
        assert [i.collectives for i in executor.infos] == ["shm", "shm"]
        assert executor._comm_path.startswith("/dev/shm/")  # noqa: SLF001
        assert not os.path.exists(executor._comm_path)  # noqa: SLF001
        got = tp2.generate(["shared memory"], greedy, use_tqdm=False)
    finally:
        tp2.shutdown()
    tp1 = LLM(tiny_model, num_kv_blocks=64, multiprocess=False)
    want = tp1.generate(["shared memory"], greedy, use_tqdm=False)
    tp1.shutdown()
    assert list(got[0].outputs[0].token_ids) == list(want[0].outputs[0].token_ids)


if __name__ == "__main__":
    _rank_main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:6])
