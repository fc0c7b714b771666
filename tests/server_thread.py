"""A real uvicorn server on a free loopback port, in a thread of its own (fake backends,
scripted engines, the proxy in-process)."""

from __future__ import annotations

import socket
import threading
from typing import Any

import uvicorn
from pd_harness import wait_until


class ServerThread:
    def __init__(self, app: Any, name: str, **config: Any) -> None:
        """`config`: uvicorn.Config's own arguments over these defaults."""
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.address = self.sock.getsockname()
        self.url = f"http://127.0.0.1:{self.address[1]}"
        config = {"log_level": "warning", "lifespan": "on", "timeout_graceful_shutdown": 1,
                  **config}
        self.server = uvicorn.Server(uvicorn.Config(app, **config))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name=f"uvicorn-{name}", daemon=True)

    def start(self) -> ServerThread:
        self.thread.start()
        wait_until(lambda: self.server.started, what=f"server {self.url} to start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
