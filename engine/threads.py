"""OpenMP defaults for an engine server's model processes, set before torch loads.

torch runs its CPU ops (and our kernels' at::parallel_for) on libgomp, the OpenMP runtime it
ships. After every parallel region libgomp's threads spin-wait for the next one, up to
GOMP_SPINCOUNT iterations (default 300 000: a few hundred microseconds) before they sleep.
A decode or prefill step is hundreds of short parallel regions with Python in between, so
while an engine is busy its OpenMP workers spin the whole time. Alone on its cores that
only wastes what nobody else wants; but a P and a D started on one node each run a pool as
wide as the node, and the spinning workers of one engine take the cores the other engine's
Python thread needs (issue 33 item 6: P 37 s + D 46 s of CPU for a load the colocated
server served with 30 s).

`apply_thread_defaults` sets a short spin (SPINCOUNT, ~tens of microseconds: long enough to
bridge the gap between two ops of one forward pass, so a lone engine loses nothing, short
enough that an idle worker sleeps while its engine runs Python or waits) unless the user
chose a wait policy of their own. It changes the environment, not torch: libgomp reads it
once, when it loads, so it must run before the process imports torch or before it spawns
the processes that will (the EngineCore and its tensor-parallel workers inherit it).
torch sizes the intra-op pool to the cores this process may run on (os.sched_getaffinity);
`CoreShare` (below) narrows it while other model processes run on the same cores.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import tempfile
import time
import uuid
import weakref
from collections.abc import Callable, MutableMapping

logger = logging.getLogger(__name__)

# Any of these set by the user means they chose the wait behaviour themselves.
USER_KNOBS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
SPINCOUNT = "10000"
# "1": this server's model processes share the node's cores (CoreShare); "0" opts out.
SHARE_ENV = "PDSERVE_CORE_SHARE"


def apply_thread_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Sets the default spin count into `environ` (default os.environ) unless the user set
    any of USER_KNOBS, and SHARE_ENV=1 unless the user set it; returns what it set ({} when
    nothing). Call from the main thread at start-up, before torch is imported or any model
    process is spawned."""
    env = os.environ if environ is None else environ
    chosen = {}
    if not any(k in env for k in USER_KNOBS):
        chosen["GOMP_SPINCOUNT"] = SPINCOUNT
    if SHARE_ENV not in env:
        chosen[SHARE_ENV] = "1"
    env.update(chosen)
    return chosen


# --- intra-op threads when model processes share cores ----------------------------------
# Each process that runs a model (the EngineCore with TP = 1, every TP worker) holds a
# locked file in one node-local directory naming the CPUs it may run on. torch sizes its
# pool to those CPUs alone, so a P and a D started on one node would each run a pool as wide
# as the node: twice as many busy threads as cores, each engine's workers waiting on the
# other's (issue 33 item 6: OMP_NUM_THREADS=1 on both cut their CPU by 4x). CoreShare keeps
# the pool at the CPUs this process may run on divided by the model processes registered on
# any of them, never above what torch chose alone; it recounts now and then, so an engine
# started first gives back its extra threads when a second one arrives and takes them again
# when it leaves. A user who sets OMP_NUM_THREADS chose for themselves: nothing changes.

REGISTRY_ENV = "PDSERVE_CORE_REGISTRY"  # the directory (tests point it at their own)
RECOUNT_S = 1.0
_IN_PROCESS: weakref.WeakSet[CoreShare] = weakref.WeakSet()  # this process's (DecodePace)


def registry_dir() -> str:
    """The node-local directory of model processes: $PDSERVE_CORE_REGISTRY, else one per uid
    in /dev/shm (or the temp directory where there is none)."""
    if path := os.environ.get(REGISTRY_ENV):
        return path
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"pdserve-cores-{os.getuid()}")


def _own_dir(path: str) -> None:
    """Creates `path` 0700, or checks that the one there is ours and not a link: another
    user's directory could make every engine here believe it shares its cores."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path}: not a 0700 directory of uid {os.getuid()}")


def _cpus_of(text: str) -> frozenset[int]:
    try:
        return frozenset(int(c) for c in text.split(",") if c)
    except ValueError:
        return frozenset()  # a torn or foreign file shares nothing with us


class CoreShare:
    """One model process's entry in the registry and the thread count it implies.

    `tick()` is called by the thread that runs the model, before each step (torch's thread
    count belongs to the calling thread); it recounts at most every `recount_s` and calls
    `set_threads` when the fair count changed. Not thread-safe: one caller."""

    def __init__(self, base_threads: int, *, directory: str | None = None,
                 cpus: frozenset[int] | None = None, recount_s: float = RECOUNT_S,
                 set_threads: Callable[[int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.base = max(1, base_threads)
        self.cpus = cpus if cpus is not None else frozenset(os.sched_getaffinity(0))
        self.dir = directory or registry_dir()
        self.recount_s = recount_s
        self.clock = clock
        self._set = set_threads
        self._next = 0.0
        self._last_sharing = 1
        self.threads = self.base
        self._file: int | None = None
        self.name = ""
        _own_dir(self.dir)
        # Written and locked under a temporary name, then renamed: a file under its final
        # name is always locked while its owner lives, so a counter never takes it for dead.
        tmp = os.path.join(self.dir, f".new-{os.getpid()}-{uuid.uuid4().hex}")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, ",".join(map(str, sorted(self.cpus))).encode())
        self.name = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.rename(tmp, os.path.join(self.dir, self.name))
        self._file = fd
        _IN_PROCESS.add(self)

    def sharing(self) -> int:
        """Live registered model processes (this one included) that may run on a CPU of ours;
        removes the files of dead ones (their lock is free)."""
        n = 1
        for entry in os.listdir(self.dir):
            if entry == self.name or entry.startswith("."):
                continue
            path = os.path.join(self.dir, entry)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                continue  # gone meanwhile, or not a file of ours
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:  # held: its owner lives
                    if _cpus_of(os.read(fd, 4096).decode(errors="replace")) & self.cpus:
                        n += 1
                    continue
                with contextlib.suppress(OSError):
                    os.unlink(path)  # its owner died without removing it
            finally:
                os.close(fd)
        return n

    def fair(self) -> int:
        self._last_sharing = self.sharing()
        return max(1, min(self.base, len(self.cpus) // self._last_sharing))

    def tick(self) -> int | None:
        """Recounts if due; returns the new thread count when it changed (after applying
        it), else None."""
        now = self.clock()
        if now < self._next:
            return None
        self._next = now + self.recount_s
        try:
            want = self.fair()
        except OSError:
            return None  # the registry went away: keep what we have
        if want == self.threads:
            return None
        logger.info("intra-op threads %d -> %d (%d CPUs, %d model processes on them)",
                    self.threads, want, len(self.cpus), self._last_sharing)
        self.threads = want
        if self._set is not None:
            self._set(want)
        return want

    def close(self) -> None:
        if self._file is None:
            return
        _IN_PROCESS.discard(self)
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.dir, self.name))
        os.close(self._file)
        self._file = None


def core_share(base_threads: int) -> CoreShare | None:
    """The CoreShare of a model process of an engine server (SHARE_ENV set to "1" by
    apply_thread_defaults), else None: an offline LLM or a benchmark keeps the threads it
    set. Where the user set OMP_NUM_THREADS the process registers (the others count it) but
    keeps their count. None too where the registry cannot be used (the pool stays as torch
    sized it, as before)."""
    if os.environ.get(SHARE_ENV) != "1":
        return None
    fixed = "OMP_NUM_THREADS" in os.environ
    import torch

    try:
        return CoreShare(base_threads, set_threads=None if fixed else torch.set_num_threads)
    except OSError as exc:
        logger.warning("intra-op threads stay at %d: core registry unusable (%s)",
                       base_threads, exc)
        return None


# --- decode steps on shared cores ----------------------------------------------------------
# A decode engine (D) whose requests' KV arrives one prefill chunk at a time from a P on the
# same cores steps as fast as it can on the few sequences it has: issue 33 item 6's load ran
# D 1386 steps against the colocated server's 136, each step's fixed cost (the forward's
# Python, the outputs, the API server's per-step work) paid ten times over, on the cores P's
# prefill needs. While the next step would only decode and more requests wait for their KV
# to land (the scheduler's `decode_awaits_kv`), and this process shares its cores with
# another model process (CoreShare counted one), DecodePace starts a step no sooner than
# PACE_ENV milliseconds (default 60) after the previous one: the arrivals join one step
# instead of each starting another, and the CPU goes to P meanwhile. A step longer than that
# is never held; a lone engine, a colocated server and a P are never held (nothing waits for
# remote KV there, or nothing shares the cores); "0" turns it off.

PACE_ENV = "PDSERVE_DECODE_PACE_MS"
PACE_MS = 60.0


def shared_cores() -> bool:
    """Whether a model process of this process counted another one on its cores at its last
    recount (CoreShare)."""
    return any(share._last_sharing > 1 for share in list(_IN_PROCESS))


class DecodePace:
    """`wait(holds)` before each step: see above. Not thread-safe: the engine loop's thread."""

    def __init__(self, interval_s: float | None = None, *,
                 shared: Callable[[], bool] = shared_cores,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if interval_s is None:
            try:
                interval_s = float(os.environ.get(PACE_ENV, PACE_MS)) / 1e3
            except ValueError:
                logger.warning("%s=%r is not a number of milliseconds: %g used", PACE_ENV,
                               os.environ[PACE_ENV], PACE_MS)
                interval_s = PACE_MS / 1e3
        self.interval_s = max(0.0, interval_s)
        self.shared, self.clock, self.sleep = shared, clock, sleep
        self.last = float("-inf")
        self.held_s = 0.0  # in all, for stats
        self.num_held = 0

    def wait(self, holds: bool) -> float:
        """Sleeps until `interval_s` after the previous step's start where `holds` and the
        cores are shared; returns the seconds slept. Marks this step's start."""
        now = self.clock()
        wait = self.last + self.interval_s - now
        if holds and wait > 0 and self.interval_s > 0 and self.shared():
            self.sleep(wait)
            self.held_s += wait
            self.num_held += 1
            now = self.clock()
        else:
            wait = 0.0
        self.last = now
        return wait
