"""A streamed P leg (proxy/handover.py): its head as soon as P has token 1, its whole stream
for an answer P ends alone, and its kv_transfer_params (the engine sends them as an event of
their own) for D's pull leg. Also the cut of D's first token out of D's first chunk.

`run_prefill_stream` never raises (except on cancellation): its outcome is a PrefillResult
like `legs.run_prefill_leg`'s, whose body on success is `{"kv_transfer_params": ...}` (what
`legs.pull_decode_params` reads from a non-streamed P answer).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from proxy.backends import BackendPool, Lease
from proxy.leg_client import LegClient
from proxy.legs import PrefillResult, post_prefill
from proxy.metrics import hop_clock, mark_backend_byte

_DONE = b"data: [DONE]"


@dataclass
class Head:
    """P's stream up to and including token 1's chunk, as the engine sent it."""

    events: list[bytes]  # whole SSE events (chat: the role chunk, then token 1's)
    finish: Any  # token 1's finish_reason ("length": P's forced max_tokens=1)
    text: str  # token 1's text
    created: int
    headers: dict[str, str]


@dataclass
class HandoverLeg:
    """What the proxy keeps of a streamed P leg; `head` resolves to None when the leg ends
    without a token chunk (failed, or an answer of another shape)."""

    head: asyncio.Future[Head | None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    # resolved with `head` by the reader itself: the waiting request's task wakes in one
    # turn of the loop (flow.Dispatcher._wait)
    wake: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    events: list[bytes] = field(default_factory=list)  # all but the kv_transfer_params event
    kv_params: Any = None
    complete: bool = False  # [DONE] seen
    error: str = ""
    headers: dict[str, str] = field(default_factory=dict)

    def feed(self, event: bytes) -> None:
        if event.startswith(_DONE):
            self.complete = True
            self.events.append(event)
            return
        obj = _data(event)
        if isinstance(obj, dict) and set(obj) == {"kv_transfer_params"}:
            self.kv_params = obj["kv_transfer_params"]
            return
        self.events.append(event)
        if isinstance(obj, dict) and "error" in obj and not self.error:
            error = obj["error"]
            self.error = str(error.get("message") if isinstance(error, dict) else error)
        if self.head.done() or not isinstance(obj, dict) or not obj.get("choices"):
            return
        choice = obj["choices"][0]
        if not isinstance(choice, dict):
            return
        delta = choice.get("delta")
        if isinstance(delta, dict) and "role" in delta:
            return  # chat's role chunk: token 1's chunk follows
        text = choice.get("text") if "text" in choice else (delta or {}).get("content")
        created = obj.get("created")
        self.head.set_result(Head(list(self.events), choice.get("finish_reason"), text or "",
                                  created if isinstance(created, int) else 0, self.headers))
        self._wake()

    def end(self) -> None:
        if not self.head.done():
            self.head.set_result(None)
            self._wake()

    def _wake(self) -> None:
        if not self.wake.done():
            self.wake.set_result(None)


def _data(event: bytes) -> Any:
    if not event.startswith(b"data: "):
        return None
    try:
        return json.loads(event[6:])
    except ValueError:
        return None


async def run_prefill_stream(
    client: LegClient, pool: BackendPool, lease: Lease, path: str,
    body: dict[str, Any], headers: dict[str, str], timeout: aiohttp.ClientTimeout,
    leg: HandoverLeg,
) -> PrefillResult:
    hop = hop_clock()  # on_body runs in the connection's callback, outside this context
    buffer = b""
    parked = False  # events after the head wait a turn of the loop

    def on_body(raw: bytes, answer_headers: dict[str, str]) -> None:
        """P's bytes, from data_received: P's head resolves leg.head (and wakes the
        request's task) in the turn it arrives."""
        nonlocal buffer, parked
        if not leg.headers:
            leg.headers = {"content-type": answer_headers.get("content-type", "")}
        buffer += raw
        if parked:
            return
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            mark_backend_byte(hop)  # P's head is relayed as it arrives
            headless = not leg.head.done()
            leg.feed(event + b"\n\n")
            if headless and leg.head.done():
                # the request's task, woken by the head, writes it to the client before
                # P's next events (in the same read, or the next) are parsed
                parked = True
                asyncio.get_running_loop().call_soon(drain)
                return

    def drain() -> None:
        nonlocal parked
        parked = False
        on_body(b"", {})

    result = await post_prefill(client, pool, lease, path, body, headers, timeout,
                                on_body=on_body, on_end=leg.end)
    if parked:
        drain()
    if not result.ok:
        return result
    if leg.error or not leg.complete:
        pool.record_failure(lease.backend, "stream_error", unreachable=False)
        return PrefillResult(result.url, 200, b"",
                             f"stream ended early: {leg.error or 'no [DONE]'}")
    answer = {} if leg.kv_params is None else {"kv_transfer_params": leg.kv_params}
    return PrefillResult(result.url, 200, json.dumps(answer).encode())


def strip_first(obj: dict[str, Any], chat: bool, text: str) -> dict[str, Any] | None:
    """D's chunk that starts with its first token (P's, whose text the client has: `text`),
    without that token: its text, logprobs entry and id. None when nothing else is in it.
    Raises ValueError when the chunk does not start with `text` (D did not continue P)."""
    obj.pop("prompt_token_ids", None)  # P's head carried the prompt's ids
    choice = obj["choices"][0]
    delta = choice.get("delta") or {}
    mine = (delta.get("content") if chat else choice.get("text")) or ""
    if not mine.startswith(text):
        raise ValueError(f"decode's first token {mine!r} is not prefill's {text!r}")
    rest = mine[len(text):]
    more = False
    choice.pop("prompt_token_ids", None)
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        choice["token_ids"] = ids[1:]
        more = more or len(ids) > 1
    lp = choice.get("logprobs")
    if isinstance(lp, dict):
        if chat:
            lp["content"] = (lp.get("content") or [])[1:]
            more = more or bool(lp["content"])
        else:
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                if isinstance(lp.get(key), list):
                    lp[key] = lp[key][1:]
            more = more or bool(lp.get("tokens"))
    if not rest and not more and choice.get("finish_reason") is None:
        return None
    if chat:
        if rest:
            delta["content"] = rest
        else:
            delta.pop("content", None)
        choice["delta"] = delta
    else:
        choice["text"] = rest
    return obj
