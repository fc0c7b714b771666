"""The shared-memory broadcast ring: every reader sees every message, in order; big messages
spill to a side segment that is freed; waits end on a sentinel or a timeout, never hang."""

from __future__ import annotations

import os
import threading
from multiprocessing import Pipe

import pytest

from engine.executor.shm_broadcast import RingGone, ShmReader, ShmWriter


def _ring(num_readers: int, **kw) -> tuple[ShmWriter, list[ShmReader]]:
    bells = [Pipe(duplex=False) for _ in range(num_readers)]
    writer = ShmWriter(num_readers, [s for _, s in bells], **kw)
    readers = [ShmReader(writer.handle, r, bells[r][0]) for r in range(num_readers)]
    return writer, readers


def _segments() -> set[str]:
    return set(os.listdir("/dev/shm"))


def test_every_reader_gets_every_message_in_order_with_spills_freed():
    before = _segments()
    writer, readers = _ring(2, num_slots=2, slot_bytes=64)
    msgs = [bytes([i]) * n for i, n in enumerate([1, 10, 59, 60, 500, 3, 70_000, 0, 7])]
    got: list[list[bytes]] = [[], []]

    def read(r: int) -> None:
        for _ in msgs:
            got[r].append(readers[r].get(timeout=30))

    threads = [threading.Thread(target=read, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for msg in msgs:  # 2 slots: the writer waits for both readers again and again
        writer.put(msg)
    for t in threads:
        t.join(30)
    assert got == [msgs, msgs]
    assert writer.num_spilled == 3  # 60, 500, 70 000 bytes + 5 header bytes > 64-byte slot
    for r in readers:
        r.close()
    writer.close()
    assert _segments() <= before  # ring and spill segments are gone


def test_a_reader_waiting_on_a_dead_peer_raises_instead_of_hanging():
    writer, (reader,) = _ring(1)
    peer_recv, peer_send = Pipe(duplex=False)
    threading.Timer(0.05, peer_send.close).start()  # the "process" at the other end dies
    with pytest.raises(RingGone):
        reader.get([peer_recv])
    with pytest.raises(TimeoutError):
        reader.get(timeout=0.05)
    writer.put(b"after")
    assert reader.get(timeout=5) == b"after"
    reader.close()
    writer.close()
