"""The engine's helper routes through the proxy: `POST /tokenize`, `POST /detokenize`,
`GET /version`, `GET /tokenizer_info` (what vLLM's server offers, lm-eval's remote tokenizer
and aiperf read). Every engine of a deployment serves the same model, so the least loaded
healthy decode backend answers, verbatim; a backend that cannot be reached is noted and the
next one is tried. The body is read with the same limit and checks as a generation request.
"""

from __future__ import annotations

from typing import Any

import httpx
from starlette.responses import Response

from proxy.backends import BackendPool
from proxy.errors import ProxyError

GET_ROUTES = ("/version", "/tokenizer_info")
POST_ROUTES = ("/tokenize", "/detokenize")


async def from_decode(control: httpx.AsyncClient, decode: BackendPool, headers: dict[str, str],
                      request_id: str, path: str, body: dict[str, Any] | None) -> Response:
    """D's answer to `path` (GET without a body, else a JSON POST), or a 503 ProxyError
    naming every backend that failed."""
    errors = []
    for backend in sorted(decode.healthy(), key=lambda b: b.outstanding):
        try:
            if body is None:
                resp = await control.get(backend.url + path, headers=headers)
            else:
                resp = await control.post(backend.url + path, json=body, headers=headers)
        except httpx.HTTPError as exc:
            decode.record_failure(backend, "connection",
                                  unreachable=isinstance(exc, httpx.ConnectError))
            errors.append(f"{backend.url}: {type(exc).__name__}: {exc}")
            continue
        if resp.status_code >= 500:
            errors.append(f"{backend.url}: answered {resp.status_code}")
            continue
        return Response(resp.content, status_code=resp.status_code,
                        media_type=resp.headers.get("content-type", "application/json"),
                        headers={"x-request-id": request_id})
    detail = "; ".join(errors) or "none in rotation"
    raise ProxyError(503, f"request {request_id}: no healthy decode backend ({detail})",
                     code="no_healthy_decode")
