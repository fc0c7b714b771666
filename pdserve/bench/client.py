"""One streamed completion request, timed from the client's side.

Timing (all `time.perf_counter()`, seconds):
  - ttft: request sent → first SSE event that carries a choice (a token);
  - itl: the gaps between successive token-carrying events (one event per engine step, so
    one gap per token when the server streams every step);
  - latency: request sent → end of the stream.
Output tokens come from the stream's final `usage` (the request asks for it with
`stream_options.include_usage`); a server that sends none is counted one token per event.

`send_completion` talks to one OpenAI-compatible server (an engine or the proxy).
`send_pd_direct` plays the proxy's part itself — the P leg and the D leg at once, as in push
mode (docs/design.md §2) — so the proxy's own cost can be measured as the difference
between the two on the same P and D.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdserve.bench.workload import BenchRequest

REQUEST_ID_HEADER = "X-Request-Id"


@dataclass
class RequestResult:
    """What one request measured. `success` is False with `error` set on any failure."""

    kind: str
    prompt_len: int | None
    success: bool = False
    error: str = ""
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0  # perf_counter at send, relative to the benchmark's start
    target: str = ""  # which server (or "pd-direct") it went to

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def completion_payload(req: BenchRequest, model: str, ignore_eos: bool,
                       extra: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if extra:
        body.update(extra)
    return body


def _error_text(status: int, raw: bytes) -> str:
    try:
        msg = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        msg = raw[:300].decode(errors="replace")
    return f"HTTP {status}: {msg}"


async def _read_stream(resp: httpx.Response, result: RequestResult, sent: float) -> None:
    """Consume an SSE completion stream into `result` (times relative to `sent`)."""
    last = sent
    events = 0
    usage_tokens: int | None = None
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        now = time.perf_counter()
        chunk = json.loads(data)
        if "error" in chunk:
            err = chunk["error"]
            raise RuntimeError(f"error event: {err.get('message', err)}"
                               if isinstance(err, dict) else f"error event: {err}")
        if chunk.get("usage"):
            usage_tokens = chunk["usage"].get("completion_tokens")
            if result.prompt_len is None:
                result.prompt_len = chunk["usage"].get("prompt_tokens")
        if not chunk.get("choices"):
            continue
        if events == 0:
            result.ttft = now - sent
        else:
            result.itl.append(now - last)
        last = now
        events += 1
    result.latency = time.perf_counter() - sent
    if events == 0:
        raise RuntimeError("the stream ended without a token")
    result.output_tokens = usage_tokens if usage_tokens is not None else events


async def send_completion(client: httpx.AsyncClient, url: str, payload: dict[str, Any],
                          req: BenchRequest, headers: dict[str, str],
                          t0: float) -> RequestResult:
    """POST a streaming completion to `url`; never raises (failures are in the result)."""
    result = RequestResult(req.kind, req.prompt_len)
    sent = time.perf_counter()
    result.start = sent - t0
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                result.error = _error_text(resp.status_code, await resp.aread())
                return result
            await _read_stream(resp, result, sent)
        result.success = True
    except (httpx.HTTPError, RuntimeError, ValueError, TypeError, KeyError,
            AttributeError) as exc:  # a malformed event is a failed request, not a crash
        result.error = f"{type(exc).__name__}: {exc}"
    return result


# ---- the proxy's part, played by the client (push mode) ----------------------------------


@dataclass(frozen=True)
class PrefillInfo:
    """P's side-channel coordinates from its GET /kv_transfer/info."""

    engine_id: str
    kv_host: str
    kv_port: int
    tp_size: int


async def fetch_prefill_info(client: httpx.AsyncClient, prefill_url: str) -> PrefillInfo:
    resp = await client.get(prefill_url.rstrip("/") + "/kv_transfer/info")
    resp.raise_for_status()
    info = resp.json()
    try:
        return PrefillInfo(info["engine_id"], info["kv_host"], int(info["kv_port"]),
                           int(info["tp_size"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"prefill {prefill_url}: bad /kv_transfer/info {info!r}") from exc


async def _prefill_leg(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                       headers: dict[str, str]) -> str:
    """'' on success, else the error."""
    try:
        resp = await client.post(url, json=body, headers=headers)
    except httpx.HTTPError as exc:
        return f"prefill leg: {type(exc).__name__}: {exc}"
    return "" if resp.status_code == 200 else "prefill leg: " + _error_text(
        resp.status_code, resp.content)


async def send_pd_direct(client: httpx.AsyncClient, prefill_url: str, decode_url: str,
                         info: PrefillInfo, payload: dict[str, Any], req: BenchRequest,
                         headers: dict[str, str], t0: float) -> RequestResult:
    """Push mode without a proxy: P leg (max_tokens=1, not streamed, do_remote_decode) and
    D leg (the request, do_remote_prefill with P's coordinates) sent at once with one
    transfer id and one request id; the result is timed on D's stream."""
    transfer_id = uuid.uuid4().hex
    leg_headers = {**headers, REQUEST_ID_HEADER: f"bench-{transfer_id}"}
    p_body = {k: v for k, v in payload.items() if k != "stream_options"}
    p_body.update(max_tokens=1, stream=False,
                  kv_transfer_params={"do_remote_decode": True, "transfer_id": transfer_id})
    d_body = {**payload, "kv_transfer_params": {
        "do_remote_prefill": True, "remote_engine_id": info.engine_id,
        "remote_host": info.kv_host, "remote_port": info.kv_port, "tp_size": info.tp_size,
        "transfer_id": transfer_id}}
    p_task = asyncio.ensure_future(_prefill_leg(client, prefill_url, p_body, leg_headers))
    try:
        result = await send_completion(client, decode_url, d_body, req, leg_headers, t0)
        p_error = await p_task
    finally:
        if not p_task.done():
            p_task.cancel()
    if result.success and p_error:
        result.success, result.error = False, p_error
    return result
