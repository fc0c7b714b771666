"""Machinery shared by the generation routes: engine calls with errors mapped to HTTP,
merging the streams of a batch of prompts, client-disconnect watching, SSE framing.

Invariants:
- A generation stream that is closed or cancelled before it finished aborts its request in
  the core (closing the engine's iterator aborts; we also call `abort` explicitly).
- ValueError from the engine → 400 naming the field; EngineDeadError → 503; neither leaks
  as a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.client.base import EngineDeadError
from engine.connector_api import ConnectorSpec
from engine.frontend.input_processor import make_internal_request_id, tokenizer_fingerprint
from engine.protocol import SamplingParams
from engine.server.errors import APIError, dead_engine_error, error_body, from_value_error

logger = logging.getLogger("pdserve.server")

REQUEST_ID_HEADER = "x-request-id"


@dataclass
class ServingContext:
    """What the route handlers need; one per app."""

    engine: Any  # AsyncLLM (or anything with its generate/abort/check_health/tokenizer)
    model_name: str
    accepted_names: frozenset[str]
    max_model_len: int | None
    tokenizer: Any
    metrics: Any = None
    # the connector's spec (per-prompt kv_transfer_params of a list of prompts), None: none
    kv_spec: ConnectorSpec | None = None
    active: set[str] = field(default_factory=set)  # internal engine request ids in flight
    # --generation-config: sampling fields a request that gives none of its own gets
    default_sampling: dict[str, Any] = field(default_factory=dict)
    tool_call_parser: str | None = None  # tool_choice auto's parser; None: auto is a 400
    _fingerprint: str | None = None  # the tokenizer's (tokenizer_fingerprint), made once
    _foreign: set[str] = field(default_factory=set)  # other fingerprints seen (logged once)

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = tokenizer_fingerprint(self.tokenizer)
        return self._fingerprint

    def with_defaults(self, body: Any, params: SamplingParams) -> SamplingParams:
        """`params` with the server's default sampling fields the client did not give."""
        given = body.model_fields_set
        if "max_completion_tokens" in given:
            given = given | {"max_tokens"}
        changes = {k: v for k, v in self.default_sampling.items() if k not in given}
        return msgspec.structs.replace(params, **changes) if changes else params

    def abort_all(self) -> int:
        """Abort every request in flight (drain deadline): each ends with finish_reason
        "abort", so streams still close with [DONE]. Returns how many were aborted."""
        ids = list(self.active)
        for rid in ids:
            with contextlib.suppress(Exception):
                self.engine.abort(rid)
        if ids:
            logger.warning("drain deadline: aborted %d request(s) still running: %s",
                           len(ids), ", ".join(ids[:8]))
        return len(ids)

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.accepted_names:
            raise APIError(f"The model `{name}` does not exist.", 404, param="model",
                           code="model_not_found")


def count_prompt(ctx: ServingContext, source: str) -> None:
    """One prompt's tokenization: "encoded" here, or "given" as token ids."""
    if ctx.metrics is not None:
        ctx.metrics.prompt_tokenizations.labels(source=source).inc()


def given_prompt_ids(ctx: ServingContext, body: Any) -> list[int] | None:
    """A request's `prompt_token_ids` (pdserve's field: a proxy tokenized the prompt once for
    both legs), used instead of rendering and encoding the prompt; None when there are none,
    or when `prompt_tokenizer` names another tokenizer than this server's (a proxy started
    with another model's --tokenizer: the caller encodes the text, and it is logged once).
    Each refusal is a 400 naming the field; ids outside the vocabulary are the input
    processor's refusal (its message starts with the field too)."""
    ids, made_by = body.prompt_token_ids, body.prompt_tokenizer
    if ids is None:
        return None
    if made_by is not None and ctx.tokenizer is not None and made_by != ctx.fingerprint:
        if made_by not in ctx._foreign and len(ctx._foreign) < 64:
            ctx._foreign.add(made_by)
            logger.warning("prompt_token_ids made by tokenizer %r, not this server's (%s): "
                           "the prompt is encoded here (is the proxy's --tokenizer the "
                           "served model?)", made_by[:32], ctx.fingerprint)
        return None
    if not ids:
        raise APIError("prompt_token_ids must not be empty", param="prompt_token_ids")
    if ctx.max_model_len is not None and len(ids) >= ctx.max_model_len:
        raise APIError(f"prompt_token_ids holds {len(ids)} tokens: no room for a generated "
                       f"token within max_model_len ({ctx.max_model_len})",
                       param="prompt_token_ids")
    count_prompt(ctx, "given")
    return list(ids)


def make_request_id(request: Request, prefix: str) -> str:
    """The client's X-Request-Id (the proxy sends one per request) or a fresh id.

    This id is a label: it names the response and the logs, and may be reused by clients at
    will. The engine never keys anything by it: each generation gets its own internal id
    (`engine_stream`), the label escaped (no ':' or ',', so no id can read as a KV
    notification such as `HB:x`) plus 8 random hex characters."""
    given = request.headers.get(REQUEST_ID_HEADER)
    if given and len(given) <= 256 and given.isprintable():
        return given
    return f"{prefix}-{uuid.uuid4().hex}"


async def engine_stream(
    ctx: ServingContext,
    prompt: Any,
    params: SamplingParams,
    request_id: str,
    kv_transfer_params: dict[str, Any] | None,
    data_parallel_rank: int | None = None,
) -> AsyncIterator[Any]:
    """The engine's outputs for one prompt, errors translated to APIError.

    `request_id` is the client's label; the engine request gets a unique internal id, and an
    abort names that id, so ending this stream never ends another request with the same
    label."""
    finished = False
    internal_id = make_internal_request_id(request_id)
    ctx.active.add(internal_id)
    try:
        pin = {} if data_parallel_rank is None else {"data_parallel_rank": data_parallel_rank}
        gen = ctx.engine.generate(prompt, params, request_id,
                                  kv_transfer_params=kv_transfer_params,
                                  internal_request_id=internal_id, **pin)
        async for out in gen:
            finished = out.finished
            yield out
    except ValueError as exc:
        raise from_value_error(exc) from exc
    except EngineDeadError as exc:
        raise dead_engine_error(exc) from exc
    finally:
        ctx.active.discard(internal_id)
        if not finished:
            with contextlib.suppress(Exception):
                ctx.engine.abort(internal_id)


async def merge_streams(
    streams: list[AsyncIterator[Any]],
) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several streams as (stream index, item). The first error ends everything.

    One stream (the common case) is passed through without tasks. Closing the merged stream
    cancels every producer, which closes its engine stream (→ abort in the core).
    """
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None, bool]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item, None, False))
            await queue.put((index, None, None, True))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((index, None, exc, True))

    tasks = [asyncio.create_task(pump(i, s), name=f"merge-{i}") for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item, exc, done = await queue.get()
            if exc is not None:
                raise exc
            if done:
                remaining -= 1
                continue
            yield index, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def wait_disconnect(request: Request) -> None:
    """Returns when the client goes away. Only call after the body has been read."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> tuple[bool, Any]:
    """Runs `work`; if the client disconnects first, cancels it (→ abort). (gone, result)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return False, task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        return True, None
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def sse(payload: Any) -> str:
    if hasattr(payload, "model_dump_json"):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_with_ids(chunk: Any, token_ids: Any, prompt_token_ids: Any = None, *,
                 prompt_on_choice: bool = True) -> str:
    """A one-choice stream chunk with vLLM's `return_token_ids` fields: the choice's new
    `token_ids`, and the prompt's ids (on the choice for completions, at the top for chat)."""
    payload = chunk.model_dump(mode="json")
    choice = payload["choices"][0]
    choice["token_ids"] = list(token_ids)
    if prompt_token_ids is not None:
        (choice if prompt_on_choice else payload)["prompt_token_ids"] = list(prompt_token_ids)
    # msgspec, not json.dumps: a disaggregated D renders every chunk this way (the proxy asks
    # for the ids), a fifth of D's API server under load. UTF-8 like model_dump_json.
    return f"data: {msgspec.json.encode(payload).decode()}\n\n"


def sse_error(exc: BaseException) -> str:
    """An error in the middle of a stream: the OpenAI error body as one SSE event."""
    if isinstance(exc, APIError):
        body = error_body(exc.message, exc.status, param=exc.param, code=exc.code)
    elif isinstance(exc, EngineDeadError):
        err = dead_engine_error(exc)
        body = error_body(err.message, err.status, code=err.code)
    else:
        logger.error("stream failed: %s: %s", type(exc).__name__, exc)
        body = error_body(f"internal server error: {type(exc).__name__}", 500)
    return sse(body)


class SSEResponse(StreamingResponse):
    """A server-sent-event stream that always watches for the client going away.

    Starlette only watches for ASGI spec < 2.4; we want the generator cancelled (and the
    request aborted in the core) promptly whatever the server, even before the next token.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], headers: dict[str, str] | None = None,
                 *, on_close: Callable[[], Awaitable[Any]] | None = None):
        base = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, headers={**base, **(headers or {})})
        self._on_close = on_close  # runs even if the client left before the first byte

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream_task = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (stream_task, watcher):
                if not t.done():
                    t.cancel()
            await asyncio.gather(stream_task, watcher, return_exceptions=True)
            for closer in (getattr(self.body_iterator, "aclose", None), self._on_close):
                if closer is not None:
                    with contextlib.suppress(Exception):
                        await closer()
        if stream_task.done() and not stream_task.cancelled():
            exc = stream_task.exception()
            if exc is not None and not isinstance(exc, OSError):
                raise exc


async def primed(stream: AsyncIterator[Any]) -> tuple[Any, AsyncIterator[Any]]:
    """Takes the first item so errors raised before the first output become an HTTP status
    (not a 200 followed by an error event). Returns (first item or None, the rest)."""
    try:
        first = await stream.__anext__()
    except StopAsyncIteration:
        return None, stream
    return first, stream
