"""Liveness across processes: a stopped, frozen or stuck EngineCore or TP worker is noticed.

Two deadlines, both in EngineConfig (docs: `--heartbeat-timeout`, `--step-timeout`):
- `heartbeat_timeout_s` (default 30 s): how long a process may give no sign of life. Each
  EngineCore process sends the frontend a heartbeat every `heartbeat_interval(...)` from its
  own thread ("EngineCoreHeartbeat_<i>", through the output thread); each TP worker stamps
  its response ring from "WorkerHeartbeat_<rank>". A heartbeat thread runs beside a long
  step (the step's torch ops release the GIL), so a long honest step never looks silent;
  only a stopped (SIGSTOP), frozen or dead process does.
- `step_timeout_s` (default 900 s): how long one step (one RPC to the TP workers, or the
  in-process forward pass) may run. Far above the longest honest step we know of (a full
  2048-token prefill chunk of a 1B model, ~4 TFLOP, takes about a minute on one slow core);
  it catches a step that is alive but makes no progress (a collective whose peer is lost).

Who acts: the frontend kills (SIGKILL) a core it has not heard from for
`heartbeat_timeout_s` and fails its requests (engine/client/mp_base.py); the TP executor
fails the engine when a worker is silent or a step overruns (engine/executor/multiproc.py);
the core's heartbeat thread ends its own process when a step runs past
`step_timeout_s + heartbeat_timeout_s` (the backstop for an in-process step). In every case
the engine stays failed after the process would have continued (SIGCONT): the stuck process
is killed, its requests were already answered with an error, and /health answers 503 naming
why until the server is restarted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from engine.core.messages import encode_heartbeat
from engine.startup import heartbeat_interval

logger = logging.getLogger(__name__)


class CoreHeartbeat:
    """Thread "EngineCoreHeartbeat_<i>" of an EngineCore process. Every interval it puts a
    heartbeat (how long the current step has run, steps done) on the loop's output queue,
    and calls `on_stuck(reason)` once when a step has run past `stuck_after_s`."""

    def __init__(self, loop: Any, engine_index: int, timeout_s: float, stuck_after_s: float,
                 on_stuck: Callable[[str], None], stop: threading.Event) -> None:
        self.loop = loop
        self.interval = heartbeat_interval(timeout_s)
        self.stuck_after_s = stuck_after_s
        self.on_stuck = on_stuck
        self.stop = stop
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"EngineCoreHeartbeat_{engine_index}")

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(self.interval):
            started = self.loop.step_started
            age = 0.0 if started is None else time.monotonic() - started
            self.loop.output_queue.put_nowait(encode_heartbeat(age, self.loop.num_steps))
            if age > self.stuck_after_s:
                self.on_stuck(f"engine core {self.loop.engine_index}: a step has run for "
                              f"{age:.0f}s, past step_timeout_s; the engine core is stuck")
                return
