"""uvicorn with draining: on SIGTERM/SIGINT the app is told to refuse new requests (503) at
once and uvicorn stops accepting connections. In-flight requests get `drain_timeout` seconds:
shortly before it, `on_drain_deadline` runs (the server aborts what is still running, so those
requests end cleanly with finish_reason "abort"); at the timeout uvicorn cancels whatever is
left as a backstop.

uvicorn re-raises a captured signal after serving, which would kill the process before the
caller shuts the engine down; this server does not, so the caller's `finally` always runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
from collections.abc import Callable, Generator, Sequence
from types import FrameType
from typing import Any, Protocol

import uvicorn

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class ServerCompanion(Protocol):
    """Something that lives as long as the server serves (e.g. a membership registration):
    `start()` once the server listens, `stop()` first thing when it begins to drain (before
    in-flight requests finish). Both run on the server's event loop; `stop()` must be bounded
    and may be called again (a no-op)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class DrainingServer(uvicorn.Server):
    def __init__(self, app: Any, *, host: str, port: int, drain_timeout: float,
                 log_level: str = "info", access_log: bool = False,
                 on_drain_deadline: Callable[[], Any] | None = None,
                 companions: Sequence[ServerCompanion] = ()) -> None:
        config = uvicorn.Config(
            app, host=host, port=port, lifespan="off", log_level=log_level,
            access_log=access_log, timeout_graceful_shutdown=drain_timeout,
            timeout_keep_alive=5, http="httptools",  # the C HTTP parser
        )
        super().__init__(config)
        self._app = app
        self._drain_timeout = drain_timeout
        self._on_drain_deadline = on_drain_deadline
        self._companions = tuple(companions)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            for companion in self._companions:
                await companion.start()

    async def stop_companions(self) -> None:
        for companion in self._companions:
            await companion.stop()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._app.state.draining = True
        await self.stop_companions()  # e.g. deregister before the drain, not after it
        timer = None
        if self._on_drain_deadline is not None:
            early = self._drain_timeout - min(1.0, self._drain_timeout / 4)
            timer = asyncio.get_running_loop().call_later(max(0.0, early),
                                                          self._on_drain_deadline)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()

    def begin_drain(self) -> None:
        self._app.state.draining = True
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            self.force_exit = True  # a second signal: stop waiting for in-flight requests
        self.begin_drain()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
