"""Measured dispatch choices of engine/kernels/linear.py, and their store.

- the skinny_linear threshold: up to how many rows the kernel beats the gemm `linear` uses
  beyond it (`large_linear`), per (dtype, threads, kernel path, the loaded model's layer
  shapes): those weights (`set_gemm_shapes`; before a model is loaded one weight of
  CALIBRATION_SHAPE, larger than a core's L2 as a model's weights are), as many copies as the
  model has layers up to twice the last cache (`streamed_copies`: where a step's weights
  outgrow the cache it reads them from memory), times 1, 2, 4, ... 128 random rows (on the
  calibration shape the AVX-512 kernel beat the gemm to 128 rows at 1 thread where on the
  bench model's layers MKL is 1.1x faster from 64); the largest row count up to which the
  kernel is not slower, counted from its first win (at 1 row the BLAS gemv can tie it), 0 if
  it never wins. The first loss after that ends it: the kernel's lead only shrinks with rows,
  so a later "win" is a close race that noise decided (one such, at 128 rows, put 1-thread
  128-token prefills of the bench model on the kernel at 1.26x their gemm time). A loss within
  TIE of the gemm is a tie: it neither counts nor ends the count (on an Intel Xeon whose L3
  holds the weight, MKL's gemv tied the kernel at 1 and 2 rows, 0.99 and 1.01-1.03, then its
  gemm took 1.9-2.2x the kernel's time at 4-8 rows: a threshold of 1 put batch-8 decodes on
  that gemm);
- the float32 gemm: from how many rows (MKL_ROWS, largest first: the smallest count from
  which it wins at every larger one; 0 where it loses at the largest) F.linear (MKL) beats
  oneDNN's matmul, which takes the rows below it. The winner depends on
  the rows more than on the shape: on an Intel Xeon (Emerald Rapids) oneDNN ran 1.0-1.15x
  MKL at 256 rows and MKL 1.04-1.11x oneDNN at 1024, on this shape and on two models' own
  (one choice measured at 256 rows had put 1024-token prefills on the slower gemm); smaller
  weights favour MKL from fewer rows (a TP=2 rank's half of the bench model's layer at 1
  thread: MKL 1.07x at 64 rows, 1.25x at 128, where the calibration shape still had oneDNN
  ahead). So it is measured on the loaded model's own layer shapes (`set_gemm_shapes`; a TP
  rank's shard), per thread count and path, MKL's losses within TIE counted as ties (on the
  bench model's full shapes the two are within 3 % at most counts, and a noisy loss at 256
  rows had ended the count there); and the
  compiled sgemm (sgemm.cpp) against the BLAS choice at each of GEMM_ROWS' row counts, on the
  same shapes, per thread count and path: the sgemm only where it wins at every one (on a Zen
  5 EPYC at 2 threads it won at 256-1024 rows and lost 1.6-1.9x at 2048-8192, where BLAS
  scales to the second thread: a choice measured at 256 rows made offline fp32 1.8x slower);
- the bf16 gemm: from how many rows (WIDEN_ROWS, largest first: the smallest count from which
  it wins at every larger one; 0 where it loses at the largest) the float32 gemm on widened
  operands beats F.linear's bf16 (oneDNN), per thread count and path;
- bf16 prefill attention on the avx512_bf16 path: vdpbf16ps pairs against float32 FMA tiles
  (prefill_attention's bf16_pairs) on ATTENTION_SHAPE, per thread count (on the Intel Xeon
  whose vdpbf16ps runs at half its FMAs' rate the tiles are 1.4x faster; on an AMD EPYC the
  pairs were 1.6x).

A measurement is trustworthy only on a machine that leaves it alone (a calibration taken at
load 15 once made offline fp32 3x slower until measured again). So candidates are timed
interleaved (each round times every candidate once, the order alternating) over ROUNDS
rounds and each keeps its minimum; and the measurement is *noisy*, and never stored, when
- a candidate's two best samples differ by more than AGREE (its minimum does not repeat) and
  by more than the candidates' best times do (with those more than AGREE apart), or
- this process's threads waited for a CPU (the scheduler's run delay) more than MAX_WAIT of
  the measurement's time per thread, or
- other processes ran on this process's CPUs more than the CPUs its threads leave free plus
  MAX_OTHERS (the machine's load, /proc/stat), or
- another process is measuring (the store's lock is held).
A look at the machine's runnable tasks (/proc/loadavg, less this process's own: its OpenMP
workers spin a while after a region) comes first, so a loaded machine costs a few
milliseconds, not a measurement; a noisy measurement stops at its first noisy
step. The process then runs a safe default (DEFAULT_ROWS; float32 gemms beyond them on
oneDNN, never MKL: linear.py) or the stored value it was checking, and measures again after
RETRY_S (doubling up to RETRY_MAX_S), and every new process tries again at its first use.
A stored value is measured again (quietly) at its first use after RECHECK_S, and at once
where the store holds it without the time it was measured (an entry of the old store,
measured without these checks): a stored choice seen wrong then is replaced.

The store is one JSON file beside the kernels' shared object (`<name>.thresholds.json`),
key -> {"v": value, "at": unix time measured}; `python -m engine.kernels --recalibrate`
measures everything again (stored where quiet). This module is handed the gemms it times
(the dispatch in linear.py passes its own), so it imports nothing above the kernels' build.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from engine.kernels import cached_path

logger = logging.getLogger(__name__)

CALIBRATION_SHAPE = (4096, 1024)  # [out, in]: 16 MiB in float32, 8 MiB in bf16
ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
GEMM_ROWS = (256, 2048)  # a short prefill chunk's rows, and a default full one
MKL_ROWS = (1024, 512, 256, 128, 64)  # F.linear (MKL) rather than oneDNN from one of these on
SHAPES_ELEMENTS = 1 << 22  # a model's layer shapes at most this many weights together (16 MiB)
LAST_CACHE_BYTES = 32 << 20  # where sysfs tells no cache size
STREAMED_BYTES_MAX = 256 << 20  # a skinny-threshold measurement's weights at most
WIDEN_ROWS = (512, 256, 128, 64)  # bf16 gemms widened to float32 from one of these rows on
ATTENTION_SHAPE = (512, 8, 4, 64)  # bf16 prefill attention: tokens, heads, kv heads, head_dim
ROUNDS = 7
AGREE = 0.15
TIE = 0.05
MAX_WAIT = 0.05
MAX_OTHERS = 0.5
PROBE_S = 0.1
DEFAULT_ROWS = 16  # decode batches on the kernel: 5x the gemm at 8 rows, no worse to 128
RETRY_S = 60.0
RETRY_MAX_S = 600.0
RECHECK_S = 86400.0

Gemm = Callable[[torch.Tensor, torch.Tensor], Any]


class Measured(NamedTuple):
    value: int | None  # None where the measurement stopped on noise
    noise: str | None  # why it is not trustworthy; None: quiet


# --- the store ------------------------------------------------------------------------


def _store() -> Path:
    name, so = cached_path()
    return so.with_name(f"{name}.thresholds.json")


def _load() -> dict[str, Any]:
    try:
        table = json.loads(_store().read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def _entry(raw: Any) -> tuple[int | None, float | None]:
    """(value, unix time measured) of a stored entry; the time is None for an old int entry,
    the value None for anything unreadable."""
    if isinstance(raw, dict) and isinstance(raw.get("v"), int):
        at = raw.get("at")
        return raw["v"], float(at) if isinstance(at, (int, float)) else None
    if isinstance(raw, int):
        return raw, None
    return None, None


_held = threading.local()  # this thread holds the store's lock (nested measurements)


@contextlib.contextmanager
def _lock(block: bool) -> Iterator[bool]:
    """The store's lock (flock beside it, dropped when its holder exits, however): yields
    whether it is held (always where `block`); a thread that holds it already holds it."""
    if getattr(_held, "yes", False):
        yield True
        return
    path = _store().with_suffix(".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        _held.yes = True
        try:
            yield True
        finally:
            _held.yes = False
            fcntl.flock(f, fcntl.LOCK_UN)


def _write(key: str, value: int) -> None:
    path = _store()
    table = {**_load(), key: {"v": int(value), "at": round(time.time())}}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".thresholds-")
    with os.fdopen(fd, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def save(key: str, value: int) -> None:
    """Store `value` under `key` (measured now), replacing what the store held for it."""
    with _lock(block=True):
        _write(key, value)


# --- noise -------------------------------------------------------------------------------


def _run_delay_s() -> float:
    """Seconds this process's threads have waited on a run queue (schedstat), 0 where the
    kernel does not say."""
    total = 0
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/schedstat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(path) as f:
                total += int(f.read().split()[1])
    return total / 1e9


def _own_runnable() -> int:
    """This process's threads runnable now (at least this one). Right after a parallel
    region its OpenMP workers spin, runnable, for GOMP_SPINCOUNT iterations (300 000 by
    default, a few ms here; the server sets fewer, engine/threads.py): counted as others,
    they had made every 2-thread measurement on a 2-core machine noisy in a process that
    had just run a model's step (`pdserve bench roofline`, an offline LLM)."""
    count = 0
    for path in glob.glob("/proc/self/task/*/stat"):
        with contextlib.suppress(OSError, ValueError):
            text = Path(path).read_text()
            count += text[text.rindex(")") + 2] == "R"
    return max(1, count)


def _busy_s(cpus: frozenset[int]) -> float:
    """CPU seconds spent on `cpus` by anyone since boot (/proc/stat), 0 where unknown."""
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    ticks = 0
    with contextlib.suppress(OSError):
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                    u, n, s, _idle, _io, irq, soft, steal = (int(v) for v in fields[:8])
                    ticks += u + n + s + irq + soft + steal
    return ticks / hz


class Watch:
    """The noise around one measurement, checked between its steps: this process's wait for
    a CPU and the others' CPU time on its CPUs since the watch started."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self.cpus = frozenset(os.sched_getaffinity(0))
        self.start = time.perf_counter()
        self.wait0, self.busy0, self.own0 = _run_delay_s(), _busy_s(self.cpus), time.process_time()

    def noise(self) -> str | None:
        wall = time.perf_counter() - self.start
        if wall <= 0:
            return None
        waited = (_run_delay_s() - self.wait0) / (wall * self.threads)
        if waited > MAX_WAIT:
            return f"threads waited for a CPU {waited:.0%} of the time"
        return self._others(wall)

    def _others(self, wall: float) -> str | None:
        others = (_busy_s(self.cpus) - self.busy0 - (time.process_time() - self.own0)) / wall
        free = max(0, len(self.cpus) - self.threads)
        if wall >= PROBE_S and others > free + MAX_OTHERS:
            return f"other processes used {others:.1f} of {len(self.cpus)} CPUs"
        return None

    @classmethod
    def probe(cls, threads: int) -> str | None:
        """The others' load now, cheaply, before a measurement: the fewest runnable tasks of
        three looks at /proc/loadavg a few ms apart, less this process's own runnable threads
        (`_own_runnable`), where this process may run on every CPU (the count is the
        machine's); else their CPU time over PROBE_S."""
        cpus = os.sched_getaffinity(0)
        free = max(0, len(cpus) - max(1, threads))
        if len(cpus) == os.cpu_count():
            runnable = []
            for i in range(3):
                with contextlib.suppress(OSError, ValueError, IndexError):
                    with open("/proc/loadavg") as f:
                        running = int(f.read().split()[3].split("/")[0])
                    runnable.append(running - _own_runnable())
                if i < 2:
                    time.sleep(0.002)
            if runnable:
                if min(runnable) > free + MAX_OTHERS:
                    return f"{min(runnable)} other tasks runnable on {len(cpus)} CPUs"
                return None
        watch = cls(threads)
        time.sleep(PROBE_S)
        return watch._others(time.perf_counter() - watch.start)


def race(fns: Sequence[Callable[[], Any]], watch: Watch | None = None,
         rounds: int = ROUNDS) -> tuple[list[float], str | None]:
    """Each candidate's best time over `rounds` interleaved rounds (after one warm call each),
    and why they are noisy (None: each one's two best samples agree within AGREE, and
    `watch` saw no noise); stops at the first round `watch` finds noisy."""
    for fn in fns:
        fn()
    samples: list[list[float]] = [[] for _ in fns]
    for r in range(rounds):
        for i in (range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))):
            start = time.perf_counter()
            fns[i]()
            samples[i].append(time.perf_counter() - start)
        if watch is not None and (noise := watch.noise()):
            return [min(s) for s in samples], noise
    for s in samples:
        s.sort()
    worst = max(s[1] / s[0] for s in samples)
    best = [s[0] for s in samples]
    # A spread only matters where it could change the answer: candidates within AGREE of
    # each other cost about the same whichever wins (the quiet 2-core EPYC's short samples
    # spread 16-21 % and were never stored), and a gap wider than the spread is decided.
    gap = max(best) / min(best)
    noisy = worst > 1 + AGREE and 1 + AGREE < gap < worst
    return best, f"best two samples {worst - 1:.0%} apart" if noisy else None


# --- the measurements --------------------------------------------------------------------


def last_cache_bytes() -> int:
    """The largest data cache one CPU of this machine sees (its L3 where it has one), from
    sysfs; LAST_CACHE_BYTES where it says nothing."""
    sizes = [0]
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        with contextlib.suppress(OSError, ValueError):
            text = Path(path).read_text().strip().upper()
            unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes) or LAST_CACHE_BYTES


def streamed_copies(dtype: torch.dtype, shapes: Sequence[tuple[int, int]], layers: int) -> int:
    """How many copies of the weights of `shapes` (`scaled_shapes`; () : CALIBRATION_SHAPE) a
    skinny-threshold measurement cycles through: the model's `layers`, up to twice the last
    cache (at most STREAMED_BYTES_MAX). A decode step reads every layer's weights once, so where
    they outgrow the cache they come from memory, and the kernel, which streams a weight once,
    gains on the gemm, which is bound by its FLOPs: bench-llama's bf16 layers (6 MiB, 8 of
    them) on a Zen 5 EPYC with 32 MiB of L3, 32 rows: the kernel 1.04x / 0.95x the gemm's time
    (1 / 2 threads) on one layer's weights in the cache, 0.87x / 0.77x on the 8 layers'
    (scripts/skinny_vs_gemm.py)."""
    one = dtype.itemsize * sum(o * i for o, i in
                               (scaled_shapes(shapes) if shapes else [CALIBRATION_SHAPE]))
    want = min(2 * last_cache_bytes(), STREAMED_BYTES_MAX)
    return max(1, min(layers, -(-want // max(one, 1))))


def _operands(dtype: torch.dtype, rows: Sequence[int], shapes: Sequence[tuple[int, int]],
              copies: int = 1) -> tuple[list[torch.Tensor], list[dict[int, torch.Tensor]]]:
    """`copies` copies of the weights of `shapes` (`scaled_shapes`; () : CALIBRATION_SHAPE),
    each a tensor of its own, and, per row count, an x of those rows for each inner size."""
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(*s, generator=gen).to(dtype)
          for _ in range(copies)
          for s in (scaled_shapes(shapes) if shapes else [CALIBRATION_SHAPE])]
    ins = sorted({w.shape[1] for w in ws})
    return ws, [{i: torch.randn(m, i, generator=gen).to(dtype) for i in ins} for m in rows]


def _on_all(gemm: Gemm, ws: list[torch.Tensor], x: dict[int, torch.Tensor]
            ) -> Callable[[], Any]:
    return lambda: [gemm(x[w.shape[1]], w) for w in ws]


def measure(kernel, dtype: torch.dtype, gemm: Gemm, stop_on_noise: bool = True,
            shapes: Sequence[tuple[int, int]] = (), layers: int = 1) -> Measured:
    """Largest row count in ROWS up to which kernel.skinny_linear is not slower than `gemm`,
    from its first win on (module docstring), on weights of `shapes` (each call times all of
    them) or CALIBRATION_SHAPE, as many copies as `streamed_copies` counts for `layers`."""
    if (noise := Watch.probe(torch.get_num_threads())) and stop_on_noise:
        return Measured(None, noise)
    ws, xs = _operands(dtype, ROWS, shapes, streamed_copies(dtype, shapes, layers))
    _on_all(gemm, ws, xs[-1])()  # settles the gemm's own choices before the watch starts
    watch, best = Watch(torch.get_num_threads()), 0
    for m, x in zip(ROWS, xs, strict=True):
        (k, t), noise2 = race([_on_all(kernel.skinny_linear, ws, x), _on_all(gemm, ws, x)],
                              watch if stop_on_noise else None)
        noise = noise or noise2 or watch.noise()
        if noise and stop_on_noise:
            return Measured(None, noise)
        if k <= t:
            best = m
        elif best and k > t * (1 + TIE):
            break
    return Measured(best, noise)


def measure_gemm(first: Gemm, second: Gemm, stop_on_noise: bool = True,
                 shapes: Sequence[tuple[int, int]] = ()) -> Measured:
    """1 where `first` is not slower than `second` at every row count of GEMM_ROWS times
    weights of `shapes` (each call times all of them) or CALIBRATION_SHAPE, else 0
    (`measure_from` down to the fewest rows)."""
    rows = sorted(GEMM_ROWS, reverse=True)
    got = measure_from(first, second, torch.float32, stop_on_noise, rows, shapes)
    return got if got.value is None else Measured(int(got.value == rows[-1]), got.noise)


def scaled_shapes(shapes: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """[out, in] weight shapes with every out cut by one factor (to at least 64) so that
    together they hold about SHAPES_ELEMENTS weights at most: a large model's layer is timed
    on the same inner sizes at a measurement's cost."""
    total = sum(o * i for o, i in shapes)
    f = min(1.0, SHAPES_ELEMENTS / max(total, 1))
    return [(max(min(o, 64), int(o * f)), i) for o, i in shapes]


def measure_from(first: Gemm, second: Gemm, dtype: torch.dtype,
                 stop_on_noise: bool = True, rows: Sequence[int] | None = None,
                 shapes: Sequence[tuple[int, int]] = (), tie: float = 0.0) -> Measured:
    """The smallest row count of `rows` (largest first; default WIDEN_ROWS) from which `first`
    is not slower than `second` (by more than `tie`) at every larger one, on weights of
    `dtype` of `shapes` (each gemm times all of them; `scaled_shapes`) or CALIBRATION_SHAPE;
    0 where it loses at the largest."""
    if (noise := Watch.probe(torch.get_num_threads())) and stop_on_noise:
        return Measured(None, noise)
    rows = WIDEN_ROWS if rows is None else rows
    ws, xs = _operands(dtype, rows, shapes)
    _on_all(first, ws, xs[0])(), _on_all(second, ws, xs[0])()  # settles their own choices
    watch, best = Watch(torch.get_num_threads()), 0
    for m, x in zip(rows, xs, strict=True):
        (a, b), noise2 = race([_on_all(first, ws, x), _on_all(second, ws, x)],
                              watch if stop_on_noise else None)
        noise = noise or noise2 or watch.noise()
        if noise and stop_on_noise:
            return Measured(None, noise)
        if a > b * (1 + tie):
            break
        best = m
    return Measured(best, noise)


def measure_attention(kernel) -> Measured:
    """1 where kernel.prefill_attention on bf16 pairs is not slower than on float32 tiles,
    over ATTENTION_SHAPE's bf16 prefill, else 0."""
    if noise := Watch.probe(torch.get_num_threads()):
        return Measured(None, noise)
    gen = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, dim = ATTENTION_SHAPE
    q = torch.randn(tokens, heads, dim, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(tokens, kv_heads, dim, generator=gen).to(torch.bfloat16) for _ in "kv")
    out = torch.empty(tokens, heads, dim)
    watch = Watch(torch.get_num_threads())
    (a, b), noise = race([lambda: kernel.prefill_attention(out, q, k, v, dim ** -0.5, True),
                          lambda: kernel.prefill_attention(out, q, k, v, dim ** -0.5, False)],
                         watch)
    noise = noise or watch.noise()
    return Measured(None, noise) if noise else Measured(int(a <= b), None)


# --- one process's view of the store ----------------------------------------------------


def measure_and_store(key: str, measure_now: Callable[[], Measured]) -> Measured:
    """Measure under the store's lock and store the result where quiet (noise otherwise, or
    "another process is measuring" where the lock is held)."""
    with _lock(block=False) as held:
        if not held:
            return Measured(None, "another process is measuring")
        got = measure_now()
        if got.noise is None and got.value is not None:
            _write(key, got.value)
        return got


class Choices:
    """This process's values of one kind of stored choice, by the arguments `key_of` turns
    into the store's key: the stored value where it is recent, else measured (and stored)
    now; where that is noisy, the stored value or `default_of(*args)` for now, measured again
    after RETRY_S (doubling). `__call__` is the dispatch's hot path: a dict hit once final."""

    def __init__(self, what: str, key_of: Callable[..., str],
                 measure_of: Callable[..., Measured], default_of: Callable[..., int]) -> None:
        self.what = what
        self.key_of, self.measure_of, self.default_of = key_of, measure_of, default_of
        self.final: dict[tuple, int] = {}
        self.pending: dict[tuple, tuple[int, float, float]] = {}  # value, retry at, backoff
        self.noise: dict[tuple, str] = {}  # why the last measurement was not stored

    def __call__(self, *args: Any) -> int:
        value = self.final.get(args)
        return value if value is not None else self._resolve(args)

    def cache_clear(self) -> None:
        self.final.clear()
        self.pending.clear()
        self.noise.clear()

    def _resolve(self, args: tuple) -> int:
        pending = self.pending.get(args)
        if pending is not None and time.monotonic() < pending[1]:
            return pending[0]
        key = self.key_of(*args)
        stored, at = _entry(_load().get(key))
        if stored is not None and at is not None and time.time() - at < RECHECK_S:
            return self._final(args, stored)
        got = measure_and_store(key, lambda: self.measure_of(*args))
        if got.noise is None and got.value is not None:
            if stored is not None and got.value != stored:
                logger.warning("%s %s: stored %d was wrong, measured %d (stored)", self.what,
                               key, stored, got.value)
            else:
                logger.info("%s %s: %d (measured, stored)", self.what, key, got.value)
            return self._final(args, got.value)
        value = stored if stored is not None else int(self.default_of(*args))
        backoff = min(RETRY_MAX_S, 2 * pending[2]) if pending is not None else RETRY_S
        self.pending[args] = (value, time.monotonic() + backoff, backoff)
        self.noise[args] = str(got.noise)
        logger.info("%s %s: %s; %d for now (%s), measured again in %.0f s", self.what, key,
                    got.noise, value, "stored" if stored is not None else "default", backoff)
        return value

    def _final(self, args: tuple, value: int) -> int:
        self.pending.pop(args, None)
        self.final[args] = value
        return value


def _shapes_tail(shapes: Sequence[tuple[int, int]]) -> str:
    """The model's layer shapes a choice was measured on, if any: ":1024x512,512x512,..."."""
    return ":" + ",".join(f"{o}x{i}" for o, i in shapes) if shapes else ""


def _path(isa: str) -> str:
    """The kernels' path and the gemm libraries' caps where set: a choice measured against
    oneDNN or MKL on AVX-512 says nothing of them capped to AVX2 (a bf16 widen choice measured
    with PDSERVE_ISA=avx2 alone, oneDNN's bf16 on AVX-512 ahead, kept the capped run's bf16
    prefill on oneDNN's AVX2 reference path at 0.26x the widened gemm)."""
    caps = [f"{v}={os.environ[v]}" for v in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
            if os.environ.get(v)]
    return isa + "".join(f"+{c}" for c in caps)


def threshold_key(dtype: torch.dtype, threads: int, isa: str,
                  shapes: Sequence[tuple[int, int]] = (), layers: int = 1) -> str:
    # ":gemm3": measured against large_linear on the weights of every layer (`streamed_copies`;
    # ":gemm2" keys were one layer's, in the cache; keys without either were against F.linear)
    tail = _shapes_tail(shapes) + (f"*{layers}" if layers > 1 else "")
    return f"{str(dtype).removeprefix('torch.')}:{threads}:{_path(isa)}:gemm3{tail}"


def gemm_key(threads: int, isa: str, shapes: Sequence[tuple[int, int]] = ()) -> str:
    # ":mkl_from": the rows from which MKL runs (keys "float32:<threads>:onednn" held one
    # choice for every row count and path; a path limits oneDNN's and MKL's ISA with it)
    return f"float32:{threads}:{_path(isa)}:mkl_from{_shapes_tail(shapes)}"


def sgemm_key(threads: int, isa: str, shapes: Sequence[tuple[int, int]] = ()) -> str:
    return f"float32:{threads}:{_path(isa)}:sgemm{_shapes_tail(shapes)}"


def widen_key(threads: int, isa: str) -> str:
    return f"bfloat16:{threads}:{_path(isa)}:widen"


def attention_key(threads: int, isa: str) -> str:
    return f"bfloat16:{threads}:{_path(isa)}:attn_pairs"
