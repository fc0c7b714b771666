"""The pieces of liveness and start-up deadlines, without engines (issue 26, findings 5, 9):
the output channel's sentinels, the ring's heartbeat, a full ring that gives up, and a
start-up stage past its deadline ending its process naming it."""

from __future__ import annotations

import subprocess
import sys
import time
from multiprocessing import Pipe

import pytest

from engine.core.messages import (
    MAX_DEAD_REASON,
    decode_dead,
    decode_heartbeat,
    encode_dead,
    encode_heartbeat,
)
from engine.executor.shm_broadcast import _BEAT, ShmReader, ShmWriter
from engine.protocol import EngineCoreOutputs
from engine.serial import MsgpackEncoder
from engine.startup import EXIT_STARTUP_STALLED, STALL_ENV


def test_dead_and_heartbeat_frames_round_trip_and_outputs_are_neither() -> None:
    assert decode_dead(encode_dead()) == ""
    assert decode_dead(encode_dead("worker 1 is not responding")) == "worker 1 is not responding"
    assert len(decode_dead(encode_dead("x" * 10_000))) == MAX_DEAD_REASON
    assert decode_heartbeat(encode_heartbeat(2.5, 7)) == (2.5, 7)
    outputs = b"".join(bytes(f) for f in MsgpackEncoder().encode(EngineCoreOutputs()))
    for frame in (outputs, b"ENGINE_CORE_DEADLY", b"ENGINE_CORE_HB", b""):
        assert decode_dead(frame) is None and decode_heartbeat(frame) is None


def _ring(slots: int = 2) -> tuple[ShmWriter, ShmReader]:
    recv, send = Pipe(duplex=False)
    writer = ShmWriter(1, [send], num_slots=slots, slot_bytes=64)
    return writer, ShmReader(writer.handle, 0, recv)


def test_ring_heartbeat_tells_a_silent_writer_from_a_live_one() -> None:
    writer, reader = _ring()
    try:
        assert reader.writer_silence_s() < 1.0
        _BEAT.pack_into(writer.ring.buf, writer.ring.beat_off, time.monotonic_ns() - 5 * 10**9)
        assert reader.writer_silence_s() >= 5.0  # stopped: no stamp for 5 s
        writer.beat()
        assert reader.writer_silence_s() < 1.0
    finally:
        reader.close()
        writer.close()


def test_a_full_ring_gives_up_when_its_check_says_the_reader_is_stuck() -> None:
    writer, reader = _ring(slots=2)

    def reader_stuck() -> None:
        raise TimeoutError("reader 0 is not responding")

    try:
        writer.put(b"a")
        writer.put(b"b")  # the reader never reads: the ring is full now
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="not responding"):
            writer.put(b"c", check=reader_stuck)
        assert time.monotonic() - started < 2.0
    finally:
        reader.close()
        writer.close()


def test_a_stage_past_its_deadline_ends_the_process_naming_it() -> None:
    code = ("from engine.startup import StartupWatch\n"
            "w = StartupWatch('unit', 1.0)\n"
            "with w.stage('kv_connector'):\n"
            "    pass\n")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin", STALL_ENV: "kv_connector"})
    assert proc.returncode == EXIT_STARTUP_STALLED, proc.stderr
    assert "unit (pid" in proc.stderr
    assert "start-up stage 'kv_connector' stalled past its deadline of 1s" in proc.stderr, \
        proc.stderr
    assert time.monotonic() - started < 30


def test_core_heartbeat_beats_and_calls_a_step_past_its_deadline_stuck() -> None:
    import queue
    import threading
    from types import SimpleNamespace

    from engine.core.liveness import CoreHeartbeat

    loop = SimpleNamespace(engine_index=0, num_steps=3, step_started=None,
                           output_queue=queue.SimpleQueue())
    stuck: list[str] = []
    done = threading.Event()
    beat = CoreHeartbeat(loop, 0, timeout_s=0.6, stuck_after_s=5.0,
                         on_stuck=lambda why: (stuck.append(why), done.set()),
                         stop=threading.Event())
    beat.start()
    age, steps = decode_heartbeat(loop.output_queue.get(timeout=5))
    assert (age, steps) == (0.0, 3) and not stuck  # idle: alive, no step
    loop.step_started = time.monotonic() - 10  # a step that has run 10 s > 5 s
    assert done.wait(5)
    assert "a step has run for 1" in stuck[0] and "stuck" in stuck[0]
