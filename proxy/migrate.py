"""Streams that survive a dead D: a streamed answer whose decode backend dies after the client
has tokens goes on, in the same response, on another decode backend.

How
  - `prepare` asks every streamed n=1 D leg for vLLM's `return_token_ids`: the first chunk
    carries the prompt's ids (`prompt_token_ids`: on the choice for completions, at the top for
    chat) and each chunk its choice's new `token_ids`. The proxy strips both fields unless the
    client asked for them itself.
  - `MigratingStream` relays D's SSE events one whole event at a time, noting the ids relayed.
    When D's stream breaks before `data: [DONE]` (a connection error, its body ending early,
    or an in-band error event) the continuation goes to another healthy D as a /v1/completions
    leg: prompt = the prompt's ids + the ids already relayed (nothing is re-tokenized),
    `max_tokens`/`min_tokens` reduced by them, no echo. Its events are rewritten into the
    client's response (id, created, model; chat deltas for a chat request) and its usage
    counts the whole answer (prompt = the client's prompt, completion = all tokens).
  - Seam: ids relayed in chunks whose text was still empty (a multi-byte character not yet
    complete, a token with no text) are not "sent": the continuation regenerates them, so the
    client gets that character whole from the new D (greedy: the same ids). A chunk can also
    carry text *and* ids D still held back (D merges the deltas a slow reader has not taken:
    text "fi", ids [fi, first byte of é]). When the last chunk with text had more than one id,
    the new D's `/detokenize` tells which of its trailing ids end in half a character (D's text
    never does mid-stream); those go back to pending (`held_ids`).
  - Bounded: `--retries` continuations per stream, each to a D not tried yet, within the
    request deadline. A stream that cannot migrate (not SSE, n>1, stop strings or logprobs,
    no prompt ids seen, no other healthy D) fails as before: an error event, then [DONE].
Counted in `pdserve:proxy_migrations_total{reason}` (reason: disconnected, eof, error_event).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import msgspec
from prometheus_client import Counter

from proxy.backends import Lease
from proxy.errors import ProxyError
from proxy.legs import (
    CHAT,
    REPLACEMENT,
    DecodeStream,
    new_id,
    next_chunk,
    open_decode_leg,
    record_connection_failure,
)


class RequestContext(Protocol):  # proxy/flow.py's, as far as a migration reads it
    route: str
    body: dict[str, Any]
    headers: dict[str, str]
    request_id: str
    migration: Any

    def remaining(self) -> float: ...


class Dispatcher(Protocol):  # proxy/flow.py's
    config: Any
    metrics: Any
    client: aiohttp.ClientSession
    decode: Any

    def _leg_timeout(self, ctx: Any) -> aiohttp.ClientTimeout: ...

logger = logging.getLogger("pdserve.proxy")
_decode = msgspec.json.decode
_encode = msgspec.json.encode

_COMPLETIONS_PATH = "/v1/completions"
_IDS = ("token_ids", "prompt_token_ids")
# Sampling fields a chat request shares with a completions continuation.
_SHARED = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
           "skip_special_tokens", "user", "stream_options")


@dataclass
class Plan:
    """What a migration needs to know about the client's request."""

    client_ids: bool  # the client asked for return_token_ids itself
    prompt_ids: list[int] | None = None
    sent: list[int] = field(default_factory=list)  # ids whose text the client has whole
    pending: list[int] = field(default_factory=list)  # ids relayed with no text yet
    last_ids: int = 0  # ids the last chunk with text made "sent" (the seam to check)
    base: int = 0  # completion tokens before the current leg
    legs: int = 0  # continuations so far
    tried: list[Any] = field(default_factory=list)  # backends that broke
    head: dict[str, Any] = field(default_factory=dict)  # id, created, model of the answer


def migratable(body: dict[str, Any]) -> bool:
    return (body.get("stream") is True and body.get("n", 1) in (1, None)
            and not body.get("stop") and not body.get("logprobs") and not body.get("echo"))


class Migrator:
    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher
        self.counter = Counter("pdserve:proxy_migrations",
                               "Streams continued on another decode backend after theirs "
                               "broke off, by how it broke.", ["reason"],
                               registry=dispatcher.metrics.registry)

    def prepare(self, ctx: RequestContext) -> None:
        """Before the legs: ask a streamed D leg for token ids (see the module doc)."""
        if migratable(ctx.body) and self.dispatcher.config.retries > 0:
            ctx.migration = Plan(client_ids=ctx.body.get("return_token_ids") is True)
            ctx.body = {**ctx.body, "return_token_ids": True}

    def wrap(self, ctx: RequestContext, stream: DecodeStream) -> DecodeStream:
        plan = ctx.migration
        if not isinstance(plan, Plan) or not stream.is_sse:
            return stream
        return MigratingStream(self, ctx, plan, stream)  # type: ignore[return-value]


class _Broke(Exception):
    def __init__(self, reason: str, exc: BaseException | None) -> None:
        super().__init__(reason)
        self.reason, self.exc = reason, exc


class MigratingStream:
    """A DecodeStream (duck-typed) over one or more D legs; `lease` is the current leg's."""

    def __init__(self, migrator: Migrator, ctx: RequestContext, plan: Plan,
                 leg: DecodeStream) -> None:
        self.migrator, self.ctx, self.plan, self.leg = migrator, ctx, plan, leg
        self.response = leg.response
        self.first_chunk: bytes | None = b""
        self.chunks: AsyncIterator[bytes] = self._events()
        self._buffer = b""
        self._done = False  # D's [DONE] relayed
        self._finished = False  # the choice's finish_reason relayed

    @property
    def lease(self) -> Lease:
        return self.leg.lease

    @property
    def is_sse(self) -> bool:
        return True

    def close(self) -> None:
        self.leg.close()

    # ---- the client's events ----------------------------------------------------------------

    async def _events(self) -> AsyncIterator[bytes]:
        raw: bytes | None = self.leg.first_chunk
        while True:
            broke: _Broke | None = None
            if raw is None:
                if self._done or self._buffer or not self._can_migrate():
                    if self._buffer:
                        yield self._buffer  # a tail that is no whole event: as D sent it
                    return  # the relay's old verdict on a body that ended
                broke = _Broke("eof", None)
            else:
                out, broke = self._feed(raw)
                if out:
                    yield out
            if broke is not None:
                if self._finished:  # the answer is whole; only the trailer was lost
                    yield b"data: [DONE]\n\n"
                    return
                raw = await self._migrate(broke)
                continue
            try:
                raw = await next_chunk(self.leg.chunks)
            except aiohttp.ClientError as exc:
                if self._finished or self._done:
                    raise
                raw = await self._migrate(_Broke("disconnected", exc))

    def _can_migrate(self) -> bool:
        return (self.plan.prompt_ids is not None and not self._finished
                and self.plan.legs < self.migrator.dispatcher.config.retries)

    def _feed(self, raw: bytes) -> tuple[bytes, _Broke | None]:
        """The whole events in `raw` (with what was buffered), rewritten for the client."""
        if self._done:
            return raw, None
        self._buffer += raw.replace(b"\r\n", b"\n")
        out: list[bytes] = []
        while b"\n\n" in self._buffer:
            event, self._buffer = self._buffer.split(b"\n\n", 1)
            data = event[len(b"data: "):] if event.startswith(b"data: ") else None
            if data is None:
                out.append(event + b"\n\n")
                continue
            if data.strip() == b"[DONE]":
                self._done = True
                out.append(event + b"\n\n" + self._buffer)
                self._buffer = b""
                break
            try:  # msgspec: every relayed event is decoded and encoded again (hot path)
                obj = _decode(data)
            except msgspec.DecodeError:
                out.append(event + b"\n\n")
                continue
            if isinstance(obj, dict) and "error" in obj and self.plan.prompt_ids is not None:
                self._buffer = b""
                return b"".join(out), _Broke("error_event", None)
            if isinstance(obj, dict):
                obj = self._note(obj)
            out.append(b"data: " + _encode(obj) + b"\n\n")
        return b"".join(out), None

    def _note(self, obj: dict[str, Any]) -> dict[str, Any]:
        finished = note_event(self.plan, obj)
        self._finished = self._finished or finished
        if self.plan.legs > 0:
            return rewrite_event(obj, self.plan, self.ctx.route == CHAT)
        return obj

    # ---- the next leg -----------------------------------------------------------------------

    async def _migrate(self, broke: _Broke) -> bytes | None:
        """Open the continuation and return its first chunk; or raise what ends the stream."""
        plan, ctx, d = self.plan, self.ctx, self.migrator.dispatcher
        old = self.leg
        if (not self._can_migrate() or self._continuation_body() is None
                or ctx.remaining() <= 0):
            raise self._give_up(broke)  # the relay counts the failure and reports it
        if broke.exc is not None:
            record_connection_failure(old.lease.pool, old.lease, broke.exc)
        else:
            old.lease.pool.record_failure(old.lease.backend, f"stream_{broke.reason}",
                                          unreachable=False)
        plan.tried.append(old.lease.backend)
        while True:
            lease = d.decode.choose(exclude=plan.tried)
            if lease is None:  # the old leg's failure is counted already
                raise self._give_up(broke)
            headers = {**ctx.headers, "x-request-id": new_id()}
            try:
                await self._settle_seam(lease, headers)
            except BaseException:  # cancelled (the deadline, the client gone)
                lease.release()
                raise
            body = self._continuation_body()  # the seam only moves ids back: not None
            assert body is not None
            try:
                leg = await open_decode_leg(d.client, d.decode, lease, _COMPLETIONS_PATH, body,
                                            headers, d._leg_timeout(ctx), ctx.request_id)
            except ProxyError as error:
                plan.tried.append(lease.backend)
                logger.warning("request %s: continuation on %s failed: %s",
                               ctx.request_id, lease.url, error.message)
                continue
            break
        old.close()
        old.lease.release()
        self.leg, self._buffer = leg, b""
        plan.legs += 1
        plan.base = len(plan.sent)
        plan.pending = []
        self.migrator.counter.labels(reason=broke.reason).inc()
        logger.warning("request %s: decode backend %s broke off the stream (%s) after %d "
                       "tokens; continuing on %s", ctx.request_id, old.lease.url, broke.reason,
                       plan.base, leg.lease.url)
        return leg.first_chunk

    async def _settle_seam(self, lease: Lease, headers: dict[str, str]) -> None:
        """Move ids D still held back in the last chunk with text from sent to pending (see
        the module doc). A D that cannot answer leaves the seam to the next D tried, and the
        last one to the chunks' text."""
        plan, d = self.plan, self.migrator.dispatcher
        span = plan.last_ids - 1
        if span <= 0:
            return
        model = self.ctx.body.get("model")

        async def decode(ids: list[int]) -> str:
            async with d.client.post(lease.url + "/detokenize", headers=headers,
                                     data=_encode({"model": model, "tokens": ids}),
                                     timeout=d._leg_timeout(self.ctx)) as resp:
                if resp.status != 200:
                    raise ValueError(f"answered {resp.status}")
                return str(_decode(await resp.read())["prompt"])

        try:
            held = await held_ids(plan.sent, span, decode)
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError,
                msgspec.DecodeError) as exc:
            logger.warning("request %s: %s/detokenize failed (%s: %s); the seam stays as the "
                           "chunks' text shows it", self.ctx.request_id, lease.url,
                           type(exc).__name__, exc)
            return
        plan.last_ids = 0  # settled: the ids left in `sent` have their text whole
        if held:
            plan.pending = plan.sent[-held:] + plan.pending
            del plan.sent[-held:]

    def _continuation_body(self) -> dict[str, Any] | None:
        plan, body = self.plan, self.ctx.body
        assert plan.prompt_ids is not None
        n = len(plan.sent)
        chat = self.ctx.route == CHAT
        limit = body.get("max_completion_tokens") if chat else None
        limit = limit if limit is not None else body.get("max_tokens", None if chat else 16)
        if limit is not None and limit - n < 1:
            return None
        leg: dict[str, Any] = ({k: body[k] for k in _SHARED if k in body} if chat
                               else {k: v for k, v in body.items() if k not in (
                                   "kv_transfer_params", "echo", "prompt_token_ids",
                                   "prompt_tokenizer")})
        leg.update(prompt=plan.prompt_ids + plan.sent, stream=True, return_token_ids=True,
                   max_tokens=None if limit is None else limit - n,
                   min_tokens=max(0, int(body.get("min_tokens") or 0) - n))
        return leg

    def _give_up(self, broke: _Broke) -> BaseException:
        if broke.exc is not None:
            return broke.exc
        return aiohttp.ClientPayloadError(f"decode stream ended early ({broke.reason})")


async def held_ids(sent: list[int], span: int,
                   decode: Callable[[list[int]], Awaitable[str]]) -> int:
    """How many of `sent`'s last `span` ids D had not rendered yet: a D's text never ends in
    half a character mid-stream (engine/frontend/detokenizer.py), so while the text through
    an id ends in U+FFFD, D still held that id back. Decoded with 8 ids of context before the
    span: a character's bytes never span more than 4 ids."""
    held = 0
    while held < span:
        end = len(sent) - held
        if not (await decode(sent[max(0, end - span - 8):end])).endswith(REPLACEMENT):
            break
        held += 1
    return held


def note_event(plan: Plan, obj: dict[str, Any]) -> bool:
    """Note the ids `obj` (one of D's stream events) relays and strip them unless the client
    asked; True when it finishes the choice. Ids whose text is still empty stay pending: the
    client has not seen their text (part of a multi-byte character, or none), so a
    continuation regenerates them instead of starting after them."""
    continuation = plan.legs > 0
    finished = False
    if not continuation and not plan.head:
        plan.head = {k: obj[k] for k in ("id", "created", "model") if k in obj}
    top_prompt = obj.pop("prompt_token_ids", None)
    if plan.prompt_ids is None and isinstance(top_prompt, list):
        plan.prompt_ids = top_prompt
    for choice in obj.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        prompt = choice.get("prompt_token_ids")
        if plan.prompt_ids is None and isinstance(prompt, list):
            plan.prompt_ids = prompt
        ids = choice.get("token_ids") or []
        text = choice.get("text") if "text" in choice else (
            (choice.get("delta") or {}).get("content"))
        if isinstance(ids, list):
            plan.pending.extend(ids)
        if text or choice.get("finish_reason") is not None:
            finished = finished or choice.get("finish_reason") is not None
            plan.last_ids = len(plan.pending)
            plan.sent.extend(plan.pending)
            plan.pending = []
        if not plan.client_ids:
            choice.pop("token_ids", None)
        if not plan.client_ids or continuation:
            choice.pop("prompt_token_ids", None)
    if plan.client_ids and top_prompt is not None and not continuation:
        obj["prompt_token_ids"] = top_prompt
    return finished


def rewrite_event(obj: dict[str, Any], plan: Plan, chat: bool) -> dict[str, Any]:
    """A continuation leg's completions event, as the client's answer goes on."""
    obj.update(plan.head)
    if chat:
        obj["object"] = "chat.completion.chunk"
        choices = []
        for c in obj.get("choices") or []:
            text = c.pop("text", "")
            choice = {"index": c.get("index", 0),
                      "delta": {"content": text} if text else {},
                      "logprobs": None, "finish_reason": c.get("finish_reason"),
                      "stop_reason": c.get("stop_reason")}
            if "token_ids" in c:
                choice["token_ids"] = c["token_ids"]
            choices.append(choice)
        obj["choices"] = choices
    usage = obj.get("usage")
    if isinstance(usage, dict) and plan.prompt_ids is not None:
        prompt = len(plan.prompt_ids)
        completion = plan.base + int(usage.get("completion_tokens", 0))
        usage.update(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion)
    return obj
