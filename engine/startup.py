"""Start-up stages with deadlines: a start-up that cannot finish ends, naming where it stood.

Each process that starts an engine piece (the server's frontend, the EngineCore process, a
tensor-parallel worker) runs its start-up as named stages (`STAGE_DEADLINES`). A
`StartupWatch` thread ("StartupWatch") checks the stage in progress; one that runs past its
deadline logs one line naming the process, the stage and the deadline, writes every thread's
stack to stderr (the server's log) and ends the process with EXIT_STARTUP_STALLED. The
frontend sees its EngineCore exit during the handshake and fails the server's start-up, so
the server exits non-zero instead of waiting.

Deadlines are far above an honest stage on a slow, busy CPU (model-sized stages get the
most); `EngineConfig.startup_stage_timeout_s` (`--startup-stage-timeout`), when given,
replaces every one of them, or, as {stage: seconds} (`STAGE=S,...`), the stages it names.

Test-only fault hook: PDSERVE_FAULT_STALL_STARTUP=<stage> makes that stage hang (the process
sleeps when it enters it), so tests prove the deadline ends it.

Also the other helpers every engine process (frontend, EngineCore, TP worker) needs to come
up: its config as spawn arguments (`config_to_dict`), `freeze_startup_objects` once it is up,
and the interval its heartbeat thread beats at (`heartbeat_interval`; engine/core/liveness.py).
They sit here, below the core and the executor, so neither reaches up into the other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import EngineConfig

logger = logging.getLogger(__name__)

EXIT_STARTUP_STALLED = 4
_SLOW_S = 20.0  # a stage slower than this (and a tenth of its deadline) is logged
STALL_ENV = "PDSERVE_FAULT_STALL_STARTUP"

# stage -> seconds. Frontend: engine_core_spawn (the core process imports torch and says
# HELLO), engine_core_start (HELLO to READY: the core stages below), engine_core_registration.
# EngineCore: model (weights, KV memory, kernels), tp_workers (spawn, rendezvous, shards,
# describe), kv_connector (NIXL agent, memory registration, side channel), io_threads,
# ready. TP worker: rendezvous, model, kv_connector, ready.
STAGE_DEADLINES: dict[str, float] = {
    "engine_core_spawn": 180.0,
    "engine_core_start": 1500.0,
    "engine_core_registration": 60.0,
    "model": 600.0,
    "tp_workers": 900.0,
    "kv_connector": 120.0,
    "io_threads": 60.0,
    "ready": 60.0,
    "rendezvous": 120.0,
}


# Stages that contain other processes' stages (tp_workers: each worker's spawn, rendezvous,
# model, kv_connector and ready; engine_core_start: the core's stages) must outlast them: an
# override gives them this many times its value, so the stage that stalled is the one named.
# engine_core_spawn (a new process importing torch) took 20 s on a 2-core machine at load 11.
_SPANS = {"tp_workers": 6, "engine_core_start": 8, "engine_core_spawn": 3}


def stage_deadline(stage: str, override: float | Mapping[str, float] | None) -> float:
    """The deadline of `stage`: from the override when given, else its default. A number
    replaces every stage's deadline (container stages get _SPANS times it); a mapping
    {stage: seconds} replaces only the stages it names."""
    if override is None:
        return STAGE_DEADLINES[stage]
    if isinstance(override, Mapping):
        return float(override.get(stage, STAGE_DEADLINES[stage]))
    return float(override) * _SPANS.get(stage, 1)


def parse_stage_timeout(text: str) -> float | dict[str, float]:
    """`--startup-stage-timeout`: SECONDS (every stage) or STAGE=SECONDS[,STAGE=SECONDS...]
    (those stages only); a ValueError names an unknown stage or a bad number."""
    if "=" not in text:
        return float(text)
    out: dict[str, float] = {}
    for part in text.split(","):
        name, _, value = part.strip().partition("=")
        if name not in STAGE_DEADLINES:
            raise ValueError(f"unknown start-up stage {name!r} (the stages: "
                             f"{', '.join(sorted(STAGE_DEADLINES))})")
        out[name] = float(value)
    return out


class StartupStalled(RuntimeError):
    """A start-up stage ran past its deadline (raised where a caller can still clean up)."""

    def __init__(self, who: str, stage: str, deadline: float) -> None:
        super().__init__(f"{who}: start-up stage {stage!r} stalled past its deadline of "
                         f"{deadline:.0f}s")
        self.stage = stage


def maybe_stall(stage: str) -> None:
    """The test-only fault hook: sleep for ever when PDSERVE_FAULT_STALL_STARTUP names it."""
    if os.environ.get(STALL_ENV) == stage:
        logger.warning("fault injection: start-up stage %r stalls (%s)", stage, STALL_ENV)
        while True:
            time.sleep(3600)


class StartupWatch:
    """Deadlines of one process's start-up stages. `stage(name)` is used on the starting
    thread; the watch thread only reads the stage in progress. `close()` when started."""

    def __init__(self, who: str, override: float | Mapping[str, float] | None = None) -> None:
        self.who = who
        self.override = override
        self._lock = threading.Lock()
        self._current: tuple[str, float, float] | None = None  # stage, deadline s, started
        self._starts: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="StartupWatch", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        deadline = stage_deadline(name, self.override)
        with self._lock:
            previous = self._current
            self._current = (name, deadline, time.monotonic())
            self._starts[name] = self._current[2]
        try:
            maybe_stall(name)
            yield
        finally:
            with self._lock:
                self._current = previous
            took = time.monotonic() - self._started(name)
            if took > max(_SLOW_S, deadline / 10):  # where a slow start-up went, in the log
                logger.warning("%s: start-up stage %r took %.1fs (deadline %.0fs)", self.who,
                               name, took, deadline)

    def _started(self, name: str) -> float:
        with self._lock:
            return self._starts.pop(name)

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            with self._lock:
                current = self._current
            if current is None:
                continue
            name, deadline, started = current
            if time.monotonic() - started > deadline:
                self._expire(name, deadline)

    def _expire(self, name: str, deadline: float) -> None:
        logger.critical("%s (pid %d): start-up stage %r stalled past its deadline of %.0fs; "
                        "exiting with code %d (stacks follow)", self.who, os.getpid(), name,
                        deadline, EXIT_STARTUP_STALLED)
        with contextlib.suppress(Exception):
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(EXIT_STARTUP_STALLED)


def config_to_dict(config: EngineConfig) -> dict[str, Any]:
    """Plain data for the spawn arguments; `EngineConfig(**d)` rebuilds (and re-validates)."""
    return dataclasses.asdict(config)


def freeze_startup_objects() -> None:
    """Collect once, then move every object alive (torch's modules, the model, the tokenizer:
    hundreds of thousands) out of the cyclic collector's reach, as vLLM does after start-up.
    Without it each full collection during serving walks them all: ~2 % of a 1024-token
    prefill's time on one core went to gc_collect_main (perf, AMD EPYC)."""
    gc.collect()
    gc.freeze()


def heartbeat_interval(timeout_s: float) -> float:
    """How often a process beats: six beats fit in the timeout, at most one a second."""
    return min(1.0, timeout_s / 6)


def stage(watch: StartupWatch | None, name: str) -> contextlib.AbstractContextManager:
    """`watch.stage(name)`, or nothing without a watch (an in-process engine, tests)."""
    return contextlib.nullcontext() if watch is None else watch.stage(name)
