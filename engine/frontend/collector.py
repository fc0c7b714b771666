"""RequestOutputCollector: the hand-off from the output handler to one `generate()` caller.

Single producer (the AsyncLLM output-handler task) and single consumer (the request's
generate() task), both on the same asyncio event loop. Memory stays bounded however far the
consumer lags: there is at most one pending output, and newer outputs fold into it.
"""

from __future__ import annotations

import asyncio

from engine.frontend.outputs import RequestOutput
from engine.protocol import RequestOutputKind


class RequestOutputCollector:
    def __init__(self, output_kind: RequestOutputKind, request_id: str = "") -> None:
        self.aggregate = output_kind == RequestOutputKind.DELTA
        self.request_id = request_id
        self.output: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput | BaseException) -> None:
        """Non-blocking. DELTA outputs merge into a pending one (text/token ids/logprobs
        concatenated, latest finish state kept); other kinds replace it. An exception
        replaces anything pending and is never replaced by a later output."""
        pending = self.output
        if pending is None or isinstance(output, BaseException):
            self.output = output
            self.ready.set()
        elif isinstance(pending, RequestOutput):
            pending.add(output, aggregate=self.aggregate)

    async def get(self) -> RequestOutput:
        """Wait for the next output; raises the exception if one was put."""
        while (output := self.output) is None:
            await self.ready.wait()
        self.output = None
        self.ready.clear()
        if isinstance(output, BaseException):
            raise output
        return output

    def get_nowait(self) -> RequestOutput | None:
        output = self.output
        if output is None:
            return None
        self.output = None
        self.ready.clear()
        if isinstance(output, BaseException):
            raise output
        return output
