#!/usr/bin/env python
"""Microbenchmark: the TP ranks' shared-memory all-reduce / all-gather
(engine/executor/shm_collectives.py) against gloo, two real rank processes, the vector sizes
of the bench model's TP layers (hidden 512: decode batches 1 / 8 / 64, a 1024-token prefill;
the logits' all-gather of 64 rows x 4096 vocabulary columns), float32 and bfloat16.

Both paths run in the same processes, interleaved (a block of gloo calls, then a block of
shm calls, repeated), so a loaded machine weighs on both alike; it reports the median
microseconds per call of each and their ratio shm / gloo.

    scripts/bench_tp_comm.py [--rounds 15] [--iters 40] [--threads 1] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

SIZES = [("all_reduce", [1, 512]), ("all_reduce", [8, 512]), ("all_reduce", [64, 512]),
         ("all_reduce", [1024, 512]), ("all_gather", [64, 4096])]


def _rank(rank: int, path: str, store: str, out: str, rounds: int, iters: int,
          threads: int) -> None:
    import torch
    import torch.distributed as dist

    from engine.executor.shm_collectives import GLOO, make_collectives

    torch.set_num_threads(threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # as the engine's ranks (worker_proc.py)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    shm, kind = make_collectives(path, rank, 2, 60.0)
    assert kind == "shm", "the shared-memory collectives did not attach"
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for op, shape in SIZES:
            x = torch.randn(shape).to(dtype)
            times: dict[str, list[float]] = {"gloo": [], "shm": []}
            for _ in range(rounds):
                for name, comm in (("gloo", GLOO), ("shm", shm)):
                    fn = getattr(comm, op)
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        fn(x.clone() if op == "all_reduce" else x)
                    times[name].append((time.perf_counter() - t0) / iters * 1e6)
            g, s = statistics.median(times["gloo"]), statistics.median(times["shm"])
            rows.append({"op": op, "shape": shape, "dtype": str(dtype).split(".")[1],
                         "bytes": x.numel() * x.element_size(), "gloo_us": round(g, 1),
                         "shm_us": round(s, 1), "shm_over_gloo": round(s / g, 3)})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(ln.split(":", 1)[1].strip() for ln in out.splitlines()
                    if ln.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--out", help="write the result here as JSON")
    args = ap.parse_args()
    from engine.executor.shm_collectives import create_segment, remove_segment

    with tempfile.TemporaryDirectory(prefix="bench-tp-comm-") as tmp:
        path = create_segment(tmp, 2)
        res = os.path.join(tmp, "rows.json")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [os.getcwd(), *filter(None, [os.environ.get("PYTHONPATH")])])}
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), path,
                                   os.path.join(tmp, "store"), res, str(args.rounds),
                                   str(args.iters), str(args.threads)], env=env)
                 for r in (0, 1)]
        codes = [p.wait(timeout=1800) for p in procs]
        remove_segment(path)
        if codes != [0, 0]:
            print(f"rank exit codes {codes}", file=sys.stderr)
            return 1
        rows = json.load(open(res))
    load = os.getloadavg()
    result = {"cpu": _cpu(), "load_average": [round(v, 2) for v in load],
              "when_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
              "rounds": args.rounds, "iters": args.iters, "threads_per_rank": args.threads,
              "rows": rows}
    print(f"{'op':<11} {'shape':<12} {'dtype':<9} {'gloo us':>9} {'shm us':>9} {'shm/gloo':>9}")
    for r in rows:
        print(f"{r['op']:<11} {str(r['shape']):<12} {r['dtype']:<9} {r['gloo_us']:>9} "
              f"{r['shm_us']:>9} {r['shm_over_gloo']:>9}")
    print(f"CPU {result['cpu']}, load average {result['load_average']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        a = sys.argv[2:]
        _rank(int(a[0]), a[1], a[2], a[3], int(a[4]), int(a[5]), int(a[6]))
        sys.exit(0)
    sys.exit(main())
