"""`pdserve bench broadcast`: one step message to N worker processes, shm ring vs ZeroMQ.

The message is a real `execute_model` RPC as the executor encodes it: a SchedulerOutput
with --decode-reqs running requests (one token each) and --new-reqs new ones of
--prompt-len tokens. Each round the writer sends it to --readers spawned processes and
waits until each has answered with a small reply, like a TP step does: over the
shared-memory broadcast ring + per-reader response rings (engine/executor), or over one
ZeroMQ PUSH socket per reader + a PULL for the replies (same bytes, ipc://). Phases
alternate (--blocks of --rounds each); the result is the median and p99 round trip of each
and their ratio (shm / zmq: below 1 the ring is faster).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time
from typing import Any

from pdserve.bench.output import emit

_ACK = b"ok"


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--readers", type=int, default=2, help="worker processes (TP size)")
    parser.add_argument("--decode-reqs", type=int, default=32)
    parser.add_argument("--new-reqs", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--result-json", default=None)


def step_message(decode_reqs: int, new_reqs: int, prompt_len: int) -> bytes:
    from engine.executor.messages import encode_call
    from engine.protocol import SamplingParams
    from engine.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    new = [NewRequestData(f"new-{i}", list(range(1000, 1000 + prompt_len)), prompt_len,
                          SamplingParams(temperature=0.0, max_tokens=128),
                          list(range(prompt_len // 16 + 1)), 0, 2) for i in range(new_reqs)]
    cached = [CachedRequestData(f"run-{i}-0123456789", [] if i % 16 else [4000 + i], 300 + i)
              for i in range(decode_reqs)]
    sched = {**{n.req_id: prompt_len for n in new}, **{c.req_id: 1 for c in cached}}
    so = SchedulerOutput(new, cached, sched, sum(sched.values()))
    return encode_call("execute_model", so, 0)


def _shm_reader(handle: bytes, rank: int, bell, reply_bell, ready) -> None:
    import msgspec

    from engine.executor.shm_broadcast import RingGone, RingHandle, ShmReader, ShmWriter

    reader = ShmReader(msgspec.msgpack.decode(handle, type=RingHandle), rank, bell)
    reply = ShmWriter(1, [reply_bell], num_slots=4)
    ready.send_bytes(msgspec.msgpack.encode(reply.handle))
    parent = [multiprocessing.parent_process().sentinel]
    try:
        while reader.get(parent) != b"stop":
            reply.put(_ACK, parent)
    except RingGone:
        pass
    reply.close()
    reader.close()


def _zmq_reader(address: str, reply_address: str) -> None:
    import zmq

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(address)
    push.connect(reply_address)
    push.send(b"ready")
    while pull.recv(copy=False).bytes != b"stop":
        push.send(_ACK)
    ctx.destroy(linger=1000)


def _shm_phase(msg: bytes, n: int, rounds: int) -> list[float]:
    import msgspec

    from engine.executor.shm_broadcast import RingHandle, ShmReader, ShmWriter

    ctx = multiprocessing.get_context("spawn")
    bells = [ctx.Pipe(duplex=False) for _ in range(n)]
    writer = ShmWriter(n, [s for _, s in bells])
    procs, replies = [], []
    for rank in range(n):
        ready_r, ready_s = ctx.Pipe(duplex=False)
        reply_r, reply_s = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_shm_reader, args=(msgspec.msgpack.encode(writer.handle), rank,
                                                  bells[rank][0], reply_s, ready_s))
        p.start()
        procs.append(p)
        handle = msgspec.msgpack.decode(ready_r.recv_bytes(), type=RingHandle)
        replies.append(ShmReader(handle, 0, reply_r))
    sentinels = [p.sentinel for p in procs]
    times = []
    for i in range(rounds + 20):
        start = time.perf_counter()
        writer.put(msg, sentinels)
        for r in replies:
            r.get(sentinels)
        if i >= 20:
            times.append(time.perf_counter() - start)
    writer.put(b"stop", sentinels)
    for p in procs:
        p.join(10)
    for r in replies:
        r.close()
    writer.close()
    return times


def _zmq_phase(msg: bytes, n: int, rounds: int) -> list[float]:
    import zmq

    ctx = multiprocessing.get_context("spawn")
    zctx = zmq.Context()
    tmp = tempfile.mkdtemp(prefix="pdserve-bench-")
    pull = zctx.socket(zmq.PULL)
    pull.bind(f"ipc://{tmp}/replies")
    pushes, procs = [], []
    for rank in range(n):
        s = zctx.socket(zmq.PUSH)
        s.bind(f"ipc://{tmp}/w{rank}")
        pushes.append(s)
        p = ctx.Process(target=_zmq_reader, args=(f"ipc://{tmp}/w{rank}", f"ipc://{tmp}/replies"))
        p.start()
        procs.append(p)
    for _ in range(n):
        pull.recv()
    times = []
    for i in range(rounds + 20):
        start = time.perf_counter()
        for s in pushes:
            s.send(msg, copy=False)
        for _ in range(n):
            pull.recv()
        if i >= 20:
            times.append(time.perf_counter() - start)
    for s in pushes:
        s.send(b"stop")
    for p in procs:
        p.join(10)
    zctx.destroy(linger=0)
    for name in os.listdir(tmp):
        os.unlink(os.path.join(tmp, name))
    os.rmdir(tmp)
    return times


def _stats(times: list[float]) -> dict[str, float]:
    times = sorted(times)
    return {"median_us": round(statistics.median(times) * 1e6, 1),
            "p99_us": round(times[int(0.99 * (len(times) - 1))] * 1e6, 1)}


def main(args: argparse.Namespace) -> int:
    msg = step_message(args.decode_reqs, args.new_reqs, args.prompt_len)
    shm: list[float] = []
    zmq_: list[float] = []
    for _ in range(args.blocks):
        shm += _shm_phase(msg, args.readers, args.rounds)
        zmq_ += _zmq_phase(msg, args.readers, args.rounds)
    s, z = _stats(shm), _stats(zmq_)
    result: dict[str, Any] = {
        "readers": args.readers, "message_bytes": len(msg), "round_trips": len(shm),
        "shm": s, "zmq": z, "ratio_median": round(s["median_us"] / z["median_us"], 3),
        "ratio_p99": round(s["p99_us"] / z["p99_us"], 3),
    }
    emit(result, args.result_json)
    return 0
