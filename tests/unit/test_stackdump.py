"""A server that never becomes healthy: the launcher's timeout names where it hung (every
process of its tree writes its Python stacks into the log on SIGUSR1, engine/stackdump.py)."""

from __future__ import annotations

import sys

import pytest

from engine.net import free_port
from pdserve.launcher import ServerProcess

HUNG = """
import threading
from engine import stackdump
stackdump.install()
def stuck_in_start_up():
    threading.Event().wait()
stuck_in_start_up()
"""


def test_a_server_that_never_answers_health_times_out_with_its_stacks(tmp_path):
    port = free_port()
    server = ServerProcess([sys.executable, "-c", HUNG], "127.0.0.1", port, None,
                           str(tmp_path / "hung.log"))
    try:
        with pytest.raises(TimeoutError) as info:
            server.wait_healthy(3)
    finally:
        server.stop(5)
    message = str(info.value)
    assert f"server on port {port} not healthy after 3s" in message
    assert "stuck_in_start_up" in message, message  # the hung frame, from the log's tail
    assert server.process.returncode is not None
