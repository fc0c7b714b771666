"""OpenAI-style error replies from the proxy: `{"error": {"message", "type", "param", "code"}}`.

Invariant: every error the proxy itself produces has this body, and every message names the
request id and, when a backend is at fault, the backend URL. A backend's own 4xx body is passed
through unchanged when it already has this shape.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse


def _error_type(status: int) -> str:
    return "invalid_request_error" if status < 500 else "server_error"


def _default_code(status: int) -> str:
    try:
        return HTTPStatus(status).phrase.lower().replace(" ", "_")
    except ValueError:
        return str(status)


def error_body(
    message: str, status: int, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _error_type(status),
            "param": param,
            "code": code if code is not None else _default_code(status),
        }
    }


class ProxyError(Exception):
    """A request the proxy answers with an error. `body` overrides the generated error body
    (used to pass a backend's own OpenAI error through)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        body: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self._body = body

    def body(self) -> dict[str, Any]:
        if self._body is not None:
            return self._body
        return error_body(self.message, self.status, param=self.param, code=self.code)

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return _AsciiJSONResponse(self.body(), status_code=self.status, headers=headers)

    def sse_event(self) -> bytes:
        """The error as one server-sent event, for failures after a stream has started."""
        return b"data: " + json.dumps(self.body()).encode() + b"\n\n"


class _AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: a backend's error body passed through
    may hold anything JSON can (a lone surrogate too), and rendering it must never fail."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def backend_error_body(raw: bytes) -> tuple[dict[str, Any] | None, str]:
    """(the backend's OpenAI error body if it has that shape, a one-line description)."""
    try:
        data = json.loads(raw)
    except ValueError:
        text = raw[:300].decode("utf-8", "replace").strip()
        return None, text or "empty body"
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        message = str(data["error"].get("message", ""))
        return data, message or json.dumps(data)[:300]
    if isinstance(data, dict) and "detail" in data:
        return None, str(data["detail"])[:300]
    return None, json.dumps(data)[:300]
