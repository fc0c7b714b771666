"""`exit_code`: the engine-core child's exit code when two threads join it at once.

Only one joiner reaps the child; multiprocessing answers None to the other until the reaper
has stored the code. Seen in CI: a test read None right after its own join returned, while
the client's monitor thread was reaping the same child.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import threading
import time

from engine.client.core_process import exit_code


def test_exit_code_waits_for_the_thread_that_reaped_the_child():
    proc = multiprocessing.get_context("spawn").Process(target=os._exit, args=(7,))
    proc.start()
    multiprocessing.connection.wait([proc.sentinel], 30)
    os.waitpid(proc.pid, 0)  # another thread's join reaps it first...
    assert proc.exitcode is None  # ...and this is what multiprocessing answers meanwhile
    # The reaper stores the code a moment later, as Popen.poll does after its waitpid.
    threading.Timer(0.1, setattr, (proc._popen, "returncode", 7)).start()
    assert exit_code(proc) == 7


def test_exit_code_of_a_running_child_is_none_at_once():
    proc = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(30,))
    proc.start()
    try:
        # A running child is not waited for: with a 60 s grace, waiting would take it all; a
        # starved machine still answers well inside 20 s (no bet on a fast CPU).
        start = time.monotonic()
        assert exit_code(proc, grace_s=60.0) is None
        assert time.monotonic() - start < 20
    finally:
        proc.kill()
        proc.join(10)
    assert exit_code(proc) == -9
