"""uvicorn's httptools protocol, writing a response's status line and headers in the same
segment as its first body message.

uvicorn writes `http.response.start` at once, alone. The proxy sends its start when it already
holds the first chunk (P's first token, D's first chunk), so the client got two segments back
to back: on two shared cores the first one wakes the client, which parses the headers while
the proxy waits for the core, and only then the token follows (0.47 ms of the proxy's hop
with the cores loaded, ~0.1 ms quiet: issue 28). aiohttp, the legs' client and the engines'
own clients, already send headers with the first body bytes. Here the start is held until
the next message of the response, then written with it in one `write`.
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle


class _Held:
    """The transport, with writes (and a close) held for the caller to replay."""

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self.data: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.data.append(data)

    def close(self) -> None:
        self.closed = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """`uvicorn.run(..., http=CoalescingHttpToolsProtocol)`: see the module doc."""

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        cycle.send = _CoalescingSend(cycle)  # type: ignore[method-assign]
        super()._start_asgi_task(cycle, app)


class _CoalescingSend:
    """One request's ASGI `send`: uvicorn's, with the start held for the next message."""

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self.cycle = cycle
        self.head = b""

    async def __call__(self, message: Any) -> None:
        kind = message["type"]
        if kind == "http.response.start" and not self.cycle.response_started:
            self.head = b"".join((await self._held_send(message)).data)
        elif self.head and kind == "http.response.body":
            head, self.head = self.head, b""
            held = await self._held_send(message)
            transport = self.cycle.transport
            if not self.cycle.disconnected:
                transport.write(b"".join([head, *held.data]))  # one segment
            if held.closed:
                transport.close()
        else:
            await RequestResponseCycle.send(self.cycle, message)

    async def _held_send(self, message: Any) -> _Held:
        """uvicorn's send of `message`, with what it writes (or closes) held."""
        cycle = self.cycle
        if cycle.flow.write_paused and not cycle.disconnected:
            await cycle.flow.drain()  # uvicorn's own wait, before the swap: none inside it
        transport, held = cycle.transport, _Held(cycle.transport)
        cycle.transport = held  # type: ignore[assignment]
        try:
            await RequestResponseCycle.send(cycle, message)
        finally:
            cycle.transport = transport
        return held
