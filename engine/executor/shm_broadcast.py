"""A shared-memory ring buffer: one writer, N readers, every reader sees every message.

Layout of one `multiprocessing.shared_memory` segment (docs/design.md §8):

    [slot 0 | ... | slot S-1] [meta: S x (written, read_0 .. read_N-1)] [sleeping_0..N-1]
    [pad to 8] [heartbeat: u64 CLOCK_MONOTONIC ns, stamped by the writer's process]

A slot holds `kind (1 byte) | length (u32) | bytes`. kind 0: the message itself; kind 1
(spill): the message did not fit, the bytes name a second segment the writer made for it
(freed by the writer once every reader has read the slot, or at close).

Flags follow the seed's protocol: the writer takes slot i when `written == 0` or every
reader flag is 1; it clears `written`, writes, clears the reader flags, fences, then sets
`written = 1`. A reader takes slot i when `written == 1` and its own flag is 0, copies the
bytes out, then sets its flag. Writer and readers walk the slots in the same order, so a
message never overtakes another.

Waiting: a reader spins (sched_yield) for `spin_s`, then marks itself sleeping and blocks on
its doorbell (a pipe) together with the sentinels it was given (a dead writer, a dead
worker); the writer rings the doorbell of sleeping readers after each message. Fences
before both checks (Dekker) make a lost wake-up impossible; the wait still wakes every
`_WAIT_SLICE_S` as a belt and braces. Nothing here pickles: messages are bytes.

Heartbeat: the writer's process stamps `beat()` from a thread of its own; a reader reads
`writer_silence_s()` (CLOCK_MONOTONIC is one clock for every process of the machine), so a
waiter can tell a slow writer from a stopped one (engine/core/liveness.py).
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections.abc import Callable
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection, wait
from multiprocessing.shared_memory import SharedMemory

import msgspec

_HEADER = struct.Struct("<BI")  # kind, length
_BEAT = struct.Struct("<Q")
_INLINE, _SPILL = 0, 1
_WAIT_SLICE_S = 0.05
_MIN_SLOT_BYTES = 64
_fence_lock = threading.Lock()


class RingGone(RuntimeError):
    """A sentinel fired while waiting: the process at the other end is gone."""


def fence() -> None:
    """A full memory barrier (a lock round trip is an atomic read-modify-write)."""
    with _fence_lock:
        pass


class RingHandle(msgspec.Struct, frozen=True):
    """What a reader needs to attach: crosses the ready pipe as msgpack."""

    name: str
    num_slots: int
    slot_bytes: int
    num_readers: int


def attach(name: str) -> SharedMemory:
    """Open a segment someone else owns without registering it with this process's resource
    tracker (Python 3.11 registers every open; the tracker would unlink it at our exit)."""
    register = resource_tracker.register
    resource_tracker.register = lambda *a, **k: None
    try:
        return SharedMemory(name=name)
    finally:
        resource_tracker.register = register


class _Ring:
    def __init__(self, shm: SharedMemory, handle: RingHandle) -> None:
        self.shm = shm
        self.handle = handle
        self.buf = shm.buf
        s, n = handle.num_slots, handle.num_readers
        self.meta_off = s * handle.slot_bytes
        self.sleep_off = self.meta_off + s * (1 + n)
        self.beat_off = _Ring.beat_offset(s, handle.slot_bytes, n)

    @staticmethod
    def beat_offset(num_slots: int, slot_bytes: int, num_readers: int) -> int:
        end = num_slots * (slot_bytes + 1 + num_readers) + num_readers
        return (end + 7) // 8 * 8

    @staticmethod
    def size(num_slots: int, slot_bytes: int, num_readers: int) -> int:
        return _Ring.beat_offset(num_slots, slot_bytes, num_readers) + _BEAT.size

    def meta(self, slot: int) -> int:
        return self.meta_off + slot * (1 + self.handle.num_readers)

    def slot(self, slot: int) -> int:
        return slot * self.handle.slot_bytes


class ShmWriter:
    """The writing end; it creates (and at close unlinks) the segment. One thread uses it."""

    def __init__(self, num_readers: int, doorbells: list[Connection], *, num_slots: int = 8,
                 slot_bytes: int = 1 << 20) -> None:
        if len(doorbells) != num_readers:
            raise ValueError("one doorbell per reader")
        if slot_bytes < _MIN_SLOT_BYTES:
            raise ValueError(f"slot_bytes must be at least {_MIN_SLOT_BYTES} (a spill's name)")
        shm = SharedMemory(create=True, size=_Ring.size(num_slots, slot_bytes, num_readers))
        shm.buf[:] = bytes(len(shm.buf))
        self.ring = _Ring(shm, RingHandle(shm.name, num_slots, slot_bytes, num_readers))
        self.beat()
        self.doorbells = doorbells
        self.seq = 0
        self.spills: dict[int, SharedMemory] = {}
        self.num_spilled = 0

    @property
    def handle(self) -> RingHandle:
        return self.ring.handle

    def beat(self) -> None:
        """Stamp the heartbeat (any thread of the writer's process)."""
        _BEAT.pack_into(self.ring.buf, self.ring.beat_off, time.monotonic_ns())

    def put(self, data: bytes | bytearray | memoryview, sentinels: list = (),
            check: Callable[[], None] | None = None) -> None:
        """Write one message. While the ring is full (a reader lags S messages behind) it
        waits, raising RingGone when a sentinel fires and calling `check` about every
        `_WAIT_SLICE_S` (it raises to give up: a stopped reader)."""
        r, h = self.ring, self.ring.handle
        i = self.seq % h.num_slots
        m = r.meta(i)
        buf = r.buf
        pause = 0.0
        next_check = time.monotonic() + _WAIT_SLICE_S
        while buf[m] and not all(buf[m + 1:m + 1 + h.num_readers]):  # readers lag S behind
            if sentinels and wait(sentinels, timeout=pause):
                raise RingGone("a reader is gone while the ring was full")
            if not sentinels:
                time.sleep(pause)
            pause = min(0.001, pause + 0.0001)
            if check is not None and time.monotonic() > next_check:
                check()
                next_check = time.monotonic() + _WAIT_SLICE_S
        old = self.spills.pop(i, None)
        if old is not None:
            _unlink(old)
        buf[m] = 0
        off, n = r.slot(i), len(data)
        if _HEADER.size + n <= h.slot_bytes:
            _HEADER.pack_into(buf, off, _INLINE, n)
            buf[off + _HEADER.size:off + _HEADER.size + n] = data
        else:
            spill = SharedMemory(create=True, size=max(n, 1))
            spill.buf[:n] = data
            self.spills[i] = spill
            self.num_spilled += 1
            name = spill.name.encode() + b"\0"
            _HEADER.pack_into(buf, off, _SPILL, n)
            buf[off + _HEADER.size:off + _HEADER.size + len(name)] = name
        buf[m + 1:m + 1 + h.num_readers] = bytes(h.num_readers)
        fence()
        buf[m] = 1
        fence()
        self.seq += 1
        for k, bell in enumerate(self.doorbells):
            if buf[r.sleep_off + k]:
                try:
                    bell.send_bytes(b"!")
                except OSError:
                    pass  # that reader is gone; its sentinel tells the owner

    def close(self) -> None:
        for spill in self.spills.values():
            _unlink(spill)
        self.spills.clear()
        _unlink(self.ring.shm)


class ShmReader:
    """Reader `rank` of a ring made by another process. One thread uses it."""

    def __init__(self, handle: RingHandle, rank: int, doorbell: Connection, *,
                 spin_s: float = 0.0002) -> None:
        self.ring = _Ring(attach(handle.name), handle)
        self.rank = rank
        self.doorbell = doorbell
        self.seq = 0
        self.spin_s = spin_s

    def writer_silence_s(self) -> float:
        """Seconds since the writer's process last stamped the heartbeat."""
        stamp = _BEAT.unpack_from(self.ring.buf, self.ring.beat_off)[0]
        return max(0.0, (time.monotonic_ns() - stamp) / 1e9)

    def _ready(self, m: int) -> bool:
        buf = self.ring.buf
        return buf[m] == 1 and buf[m + 1 + self.rank] == 0

    def get(self, sentinels: list = (), timeout: float | None = None) -> bytes:
        """The next message. Raises RingGone when a sentinel fires first, TimeoutError after
        `timeout` seconds (None: wait for ever)."""
        r, h = self.ring, self.ring.handle
        i = self.seq % h.num_slots
        m = r.meta(i)
        if not self._ready(m):
            self._wait(m, sentinels, timeout)
        off = r.slot(i)
        kind, n = _HEADER.unpack_from(r.buf, off)
        body = off + _HEADER.size
        if kind == _INLINE:
            data = bytes(r.buf[body:body + n])
        else:
            end = bytes(r.buf[body:body + 256]).index(b"\0")
            spill = attach(bytes(r.buf[body:body + end]).decode())
            data = bytes(spill.buf[:n])
            spill.close()
        fence()
        r.buf[m + 1 + self.rank] = 1
        fence()
        self.seq += 1
        return data

    def _wait(self, m: int, sentinels: list, timeout: float | None) -> None:
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        while time.monotonic() - start < self.spin_s:
            if self._ready(m):
                return
            os.sched_yield()
        sleep_flag = self.ring.sleep_off + self.rank
        while True:
            while self.doorbell.poll():
                self.doorbell.recv_bytes()
            self.ring.buf[sleep_flag] = 1
            fence()
            if self._ready(m):
                self.ring.buf[sleep_flag] = 0
                return
            left = _WAIT_SLICE_S if deadline is None else min(_WAIT_SLICE_S,
                                                              deadline - time.monotonic())
            fired = wait([self.doorbell, *sentinels], timeout=max(0.0, left))
            self.ring.buf[sleep_flag] = 0
            if self._ready(m):
                return
            if any(s in fired for s in sentinels):
                raise RingGone("the process at the other end of the ring is gone")
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError("no message on the ring in time")

    def close(self, unlink: bool = False) -> None:
        """unlink: also remove the segment — its writer was killed and could not."""
        if unlink:
            _unlink(self.ring.shm)
        else:
            self.ring.shm.close()


def _unlink(shm: SharedMemory) -> None:
    try:
        shm.close()
    except BufferError:
        pass  # a memoryview into it is still alive; unlinking below still frees the name
    try:
        shm.unlink()
    except FileNotFoundError:
        pass
