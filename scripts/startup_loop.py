"""Start a 1P1D push pair N times in a row and report how many reached READY, and how long
each start-up took (issue 26, finding 9: a D that once never became ready).

    .venv/bin/python scripts/startup_loop.py [--rounds 20] [--model DIR] [--tp 1]
        [--timeout 180] [--stage-timeout S] [--logs DIR]

Each round launches P and D side by side (as tests/pd_harness.py does: free ports, the test
environment), waits for each /health to answer 200, then stops both. A server that is not
ready within --timeout has its process tree's stacks written into its log (SIGUSR1) before
it is stopped; every log is kept under --logs. With start-up stage deadlines a stalled stage
ends its server by itself (non-zero exit, a log line naming the stage). Exit status: 0 when
every round reached READY.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from pd_harness import TEST_ENV, role_args  # noqa: E402

from engine.net import free_port  # noqa: E402
from pdserve.launcher import ServerProcess, launch_server  # noqa: E402


def _start(model: str, role: str, engine_id: str, args: argparse.Namespace) -> ServerProcess:
    more = ["--tensor-parallel-size", str(args.tp)]
    if args.stage_timeout:
        more += ["--startup-stage-timeout", str(args.stage_timeout)]
    return launch_server(model, *role_args(128, None, "NixlPushConnector", engine_id,
                                           free_port(count=2), *more),
                         module=role, env=TEST_ENV, wait=False,
                         log_path=os.path.join(args.logs, f"{engine_id}.log"))


def _ready_time(server: ServerProcess, started: float, timeout: float) -> tuple[float, str]:
    try:
        server.wait_healthy(timeout)
        return time.monotonic() - started, ""
    except (RuntimeError, TimeoutError) as e:
        return time.monotonic() - started, str(e).splitlines()[0]


def one_round(model: str, i: int, args: argparse.Namespace) -> dict[str, object]:
    started = time.monotonic()
    p = _start(model, "prefill", f"P{i}", args)
    d = _start(model, "decode", f"D{i}", args)
    try:
        p_s, p_err = _ready_time(p, started, args.timeout)
        d_s, d_err = _ready_time(d, started, args.timeout)
    finally:
        codes = (p.stop(10), d.stop(10))
    return {"round": i, "p_s": p_s, "d_s": d_s, "ok": not p_err and not d_err,
            "errors": [e for e in (p_err, d_err) if e], "exit": codes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--model", default=None, help="default: a tiny llama made here")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--stage-timeout", type=float, default=None)
    parser.add_argument("--logs", default=None)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args.logs = args.logs or tempfile.mkdtemp(prefix="pdserve-startup-loop-")
    model = args.model
    if model is None:
        from engine.models.tiny import make_tiny_model

        model = os.path.join(args.logs, "tiny-llama")
        make_tiny_model(model, arch="llama", size="tiny", seed=0)
    results = []
    for i in range(args.rounds):
        r = one_round(model, i, args)
        results.append(r)
        print(f"round {i:2d}: P ready {r['p_s']:6.1f}s  D ready {r['d_s']:6.1f}s  "
              f"{'READY' if r['ok'] else 'FAILED ' + '; '.join(r['errors'])}", flush=True)
    ok = [r for r in results if r["ok"]]
    both = [max(r["p_s"], r["d_s"]) for r in ok]
    print(f"{len(ok)}/{len(results)} rounds reached READY"
          + (f"; pair ready in median {statistics.median(both):.1f}s, max {max(both):.1f}s"
             if both else "") + f"; logs in {args.logs}")
    return 0 if len(ok) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
