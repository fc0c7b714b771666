"""The core process's shared output socket (engine/core/output_sender.py): the busy loop
sends a step's outputs itself when it can, else they queue for the output thread in order,
and the loop never blocks on a full socket. Real zmq sockets, real msgpack frames."""

from __future__ import annotations

import os
import threading
import time

import pytest
import zmq

from engine.core.output_sender import OutputSender
from engine.protocol import EngineCoreOutput, EngineCoreOutputs
from engine.serial import MsgpackDecoder


def outputs(i: int) -> EngineCoreOutputs:
    return EngineCoreOutputs(engine_index=0, timestamp=float(i), outputs=[
        EngineCoreOutput(request_id=f"r{i}", new_token_ids=[i])])


@pytest.fixture()
def pair():
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://127.0.0.1:{port}")
    yield push, pull
    push.close()
    pull.close(linger=0)
    ctx.term()


def received(pull: zmq.Socket, count: int) -> list[EngineCoreOutputs]:
    decoder = MsgpackDecoder(EngineCoreOutputs)
    got = []
    for _ in range(count):
        assert pull.poll(5000), f"only {len(got)} of {count} messages arrived"
        got.append(decoder.decode(pull.recv_multipart(copy=False)))
    return got


def test_the_loop_sends_at_once_when_the_socket_is_free(pair):
    push, pull = pair
    sender = OutputSender()
    assert not sender.try_now(outputs(0))  # no socket yet (output thread not connected)
    sender.sock = push
    assert sender.try_now(outputs(1))
    assert [o.outputs[0].request_id for o in received(pull, 1)] == ["r1"]


def test_outputs_queued_before_keep_the_loop_from_overtaking_them(pair):
    push, _ = pair
    sender = OutputSender()
    sender.sock = push
    sender.queued = 1  # an older step's outputs wait for the output thread
    assert not sender.try_now(outputs(2))
    with sender.lock:  # the output thread is sending: the loop does not wait for it
        assert not sender.try_now(outputs(3))


def test_a_full_socket_never_blocks_the_loop():
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 1)
    push.setsockopt(zmq.LINGER, 0)
    push.bind("tcp://127.0.0.1:*")  # nobody connected: PUSH has no pipe, sends would block
    sender = OutputSender()
    sender.sock = push
    assert not sender.try_now(outputs(4))
    push.close()
    ctx.term()


def test_inline_and_queued_sends_arrive_in_step_order(pair):
    """The EngineCoreProc discipline (its `_emit` and output thread) with a slow thread:
    every message arrives once, in the order the loop emitted it."""
    push, pull = pair
    sender = OutputSender()
    sender.sock = push
    queue: list[EngineCoreOutputs] = []
    cv = threading.Condition()
    done = threading.Event()

    def output_thread() -> None:
        while True:
            with cv:
                while not queue and not done.is_set():
                    cv.wait()
                if not queue:
                    return
                item = queue.pop(0)
            with sender.lock:
                sender.send(item)
                sender.queued -= 1

    t = threading.Thread(target=output_thread)
    t.start()
    inline = 0
    for i in range(200):
        if i % 7 == 0:  # the output thread holds the socket (a heartbeat) now and then
            sender.lock.acquire()
        try:
            if sender.try_now(outputs(i)):
                inline += 1
                continue
        finally:
            if sender.lock.locked() and i % 7 == 0:
                sender.lock.release()
        with sender.lock:
            sender.queued += 1
        with cv:
            queue.append(outputs(i))
            cv.notify()
        if i % 10 == 9:  # let the output thread catch up: the loop may send again after
            deadline = time.monotonic() + 10
            while sender.queued and time.monotonic() < deadline:
                os.sched_yield()
    with cv:
        done.set()
        cv.notify()
    t.join(10)
    got = received(pull, 200)
    assert [o.outputs[0].new_token_ids[0] for o in got] == list(range(200))
    assert 0 < inline < 200
