"""OpenAI-style error replies: `{"error": {"message", "type", "param", "code"}}`.

Invariant: every error the server sends, from any layer (middleware, validation, handlers,
unexpected exceptions), has this body. Client mistakes are 4xx; only the engine being
unavailable (503) or a server bug (500) is 5xx.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.client.base import EngineDeadError
from engine.client.dp_lb_client import is_rank_death

logger = logging.getLogger("pdserve.server")

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """Raised anywhere in a handler; becomes the OpenAI error body with `status`."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        *,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code


def error_body(
    message: str, status: int, *, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": _printable(message),
            "type": _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
            "param": None if param is None else _printable(param),
            "code": code if code is not None else _default_code(status),
        }
    }


def _printable(text: str) -> str:
    """`text` with anything UTF-8 cannot carry (lone surrogates a client sent, echoed in a
    message) escaped, so rendering an error can never fail into a 500."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _default_code(status: int) -> str:
    try:
        return HTTPStatus(status).phrase.lower().replace(" ", "_")
    except ValueError:
        return str(status)


def error_response(
    message: str, status: int, *, param: str | None = None, code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(
        error_body(message, status, param=param, code=code), status_code=status, headers=headers
    )


# Request fields an engine ValueError may start with ("max_tokens must be at least 1").
_PARAMS = frozenset({
    "prompt", "prompt_token_ids", "messages", "model", "n", "best_of", "temperature",
    "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "max_tokens", "max_completion_tokens",
    "min_tokens", "ignore_eos", "logprobs", "top_logprobs", "kv_transfer_params",
    "request_id", "stream_options", "tokens", "data_parallel_rank",
})


def from_value_error(exc: ValueError) -> APIError:
    """The engine's ValueErrors name the offending field first; it becomes `param`."""
    message = str(exc) or "invalid request"
    first = message.split(" ", 1)[0].strip(":,")
    return APIError(message, 400, param=first if first in _PARAMS else None)


def request_failed_error(request_id: str, error: str | None) -> APIError:
    """A request the engine ended with an error: 503 when its data-parallel engine died
    under it (the engine is unavailable, as for EngineDeadError), else 500."""
    if is_rank_death(error):
        return APIError(f"the engine is unavailable: request {request_id} failed: {error}",
                        503, code="engine_dead")
    return APIError(f"request {request_id} failed: {error}", 500, code="request_failed")


def dead_engine_error(exc: BaseException | None = None) -> APIError:
    detail = f": {exc}" if exc is not None and str(exc) else ""
    return APIError(f"the engine is unavailable{detail}", 503, code="engine_dead")


def _param_path(loc: Any) -> tuple[str | None, bool]:
    """('body', 'prompt', 'list[int]', 0) -> ('prompt', True): the field path up to the
    first union-member tag pydantic inserts, and whether there was one."""
    parts = []
    for p in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(p, int):
            parts.append(str(p))
        elif isinstance(p, str) and p.isidentifier() and p not in _TYPE_TAGS:
            parts.append(p)
        else:
            return ".".join(parts) or None, True
    return ".".join(parts) or None, False


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "bytes", "tuple"}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    err = errors[0]
    kind = err.get("type", "")
    if kind == "inadmissible_body":  # body_check's verdict on the whole body
        path = (err.get("ctx") or {}).get("path")
        return err.get("msg", "inadmissible body"), path
    param, union = _param_path(err.get("loc", ()))
    if union and param is not None:  # every member of a union rejected the value
        got = repr(err.get("input"))[:80]
        return f"{param}: invalid type or value {got}", param
    if kind == "json_invalid":
        ctx = err.get("ctx") or {}
        return f"malformed JSON body: {ctx.get('error', err.get('msg', ''))}", None
    if kind == "missing" and param is None:
        return "the request needs a JSON body", None
    if param is None and kind.endswith("_type"):
        return "the request body must be a JSON object", None
    if kind in ("model_attributes_type", "model_type", "dict_type"):
        return f"{param}: must be a JSON object", param
    more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    return f"{param or 'body'}: {err.get('msg', 'invalid value')}{more}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.message, exc.status, param=exc.param, code=exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(message, 400, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(status).phrase
        if status == 400 and "parsing the body" in message:
            cause = exc.__cause__
            message = ("malformed request body: JSON nested too deeply"
                       if isinstance(cause, RecursionError)
                       else "malformed request body: " + str(cause or message))
        return error_response(message, status, headers=getattr(exc, "headers", None))

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        err = dead_engine_error(exc)
        return error_response(err.message, err.status, code=err.code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(f"internal server error: {type(exc).__name__}", 500)
