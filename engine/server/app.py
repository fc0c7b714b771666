"""The FastAPI app of one engine server: OpenAI routes, health, metrics, tokenizer helpers,
and `/kv_transfer/info` for the proxy.

`build_app` takes an engine that is already running (an AsyncLLM, or any object with its
interface), so tests can serve an in-process engine; `engine.server.cli` owns start-up and
shutdown of the real one.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from engine.client.base import EngineDeadError
from engine.connector_api import ConnectorSpec
from engine.server.chat import create_chat_completion, render_chat_prompt
from engine.server.completions import create_completion
from engine.server.errors import APIError, dead_engine_error, install_error_handlers
from engine.server.metrics import ServerMetrics
from engine.server.middleware import GuardMiddleware
from engine.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from engine.server.serving import ServingContext
from engine.server.tokenizer_info import tokenizer_info

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class ServerSettings:
    """HTTP-level settings (the engine's own live in EngineConfig)."""

    api_key: str | None = None  # guards every route but /health (and public /metrics)
    public_metrics: bool = False  # /metrics without the API key
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    kv_transfer_info: dict[str, Any] | None = None  # None → GET /kv_transfer/info is 404
    kv_spec: ConnectorSpec | None = None  # the engine's connector, None: no connector
    served_aliases: tuple[str, ...] = ()  # further --served-model-name names (listed)
    chat_template: str | None = None  # --chat-template: replaces the model's
    tool_call_parser: str | None = None  # tool_choice auto's parser (engine/server/tools.py)
    default_sampling: dict[str, Any] = field(default_factory=dict)  # --generation-config

    def __post_init__(self) -> None:
        if self.max_request_body_bytes < 1024:
            raise ValueError("max_request_body_bytes must be at least 1024")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")


class EngineClient(Protocol):
    """What the app needs of a running engine (`engine.frontend.async_llm.AsyncLLM`); tests
    may serve any object with these. Every coroutine runs on the server's event loop."""

    tokenizer: Any
    max_model_len: int

    async def check_health(self) -> None: ...  # raises EngineDeadError naming why

    async def get_stats(self) -> dict[str, Any]: ...

    async def debug_prompt_kv(self, prompt_token_ids: list[int]) -> list[str]: ...

    async def kv_transfer_info(self) -> dict[str, Any]:
        """What the connector's worker halves bound (engine id, side-channel host and
        ports), served over the configured values at /kv_transfer/info; with data parallel
        also `data_parallel_ranks`, each live rank's (by `rank`); {} without a connector."""

    @property
    def dead_data_parallel_ranks(self) -> list[int]: ...  # [] without data parallel


def _version() -> str:
    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:
        return "0.0.0+local"


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def build_app(
    engine: EngineClient,
    *,
    model_name: str,
    accepted_model_names: tuple[str, ...] = (),
    settings: ServerSettings | None = None,
    metrics: ServerMetrics | None = None,
) -> FastAPI:
    """The app serving `engine`. `engine` must be running; the app never starts or stops it."""
    settings = settings or ServerSettings()
    app = FastAPI(title="pdserve", version=_version(), docs_url=None, redoc_url=None)
    app.state.draining = False
    app.state.engine = engine
    app.state.metrics = metrics or ServerMetrics(
        model_name, with_transfer=settings.kv_spec is not None, kv_spec=settings.kv_spec)
    app.state.metrics.bind_max_model_len(engine.max_model_len)  # vLLM's token buckets
    ctx = ServingContext(
        engine=engine,
        model_name=model_name,
        accepted_names=frozenset((model_name, *accepted_model_names,
                                  *settings.served_aliases)),
        max_model_len=engine.max_model_len,
        tokenizer=engine.tokenizer,
        metrics=app.state.metrics,
        kv_spec=settings.kv_spec,
        default_sampling=dict(settings.default_sampling),
        tool_call_parser=settings.tool_call_parser,
    )
    if settings.chat_template is not None:
        engine.tokenizer.chat_template = settings.chat_template
        vars(engine.tokenizer).pop("_compiled_template", None)  # compiled from the old one
    app.state.ctx = ctx
    install_error_handlers(app)
    app.add_middleware(
        GuardMiddleware,
        api_key=settings.api_key,
        max_body_bytes=settings.max_request_body_bytes,
        is_draining=lambda: app.state.draining,
        public_metrics=settings.public_metrics,
        on_error=lambda path, status: _count_error(app, path, status),
    )

    async def engine_alive() -> None:
        try:
            await _maybe_await(engine.check_health())
        except EngineDeadError as exc:
            raise dead_engine_error(exc) from exc

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        await engine_alive()
        return await create_completion(body, request, ctx)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        await engine_alive()
        return await create_chat_completion(body, request, ctx)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=model_name,
                                         max_model_len=ctx.max_model_len)
                               for name in (model_name, *settings.served_aliases)])

    @app.get("/health")
    async def health() -> Response:
        await engine_alive()
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        # Stats ride on outputs; refresh them so counters that moved after the last output
        # (a WRITE finishing, a lease expiring) are current.
        try:
            stats = await asyncio.wait_for(engine.get_stats(), timeout=2.0)
            per_engine = stats.get("engines") or {None: stats}  # data parallel: per rank
            for rank, one in per_engine.items():
                app.state.metrics.update_scheduler_stats(
                    {**one, "num_total_blocks": one["num_kv_blocks"]},
                    None if rank is None else int(rank))
        except Exception:  # noqa: BLE001 - a dead or slow engine still gets its last numbers
            pass
        return Response(app.state.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/engine_stats")
    async def engine_stats() -> dict[str, Any]:
        """Block and connector-table accounting (tests and operators check for leaks)."""
        await engine_alive()
        return await engine.get_stats()

    if os.environ.get("PDSERVE_DEBUG_ROUTES") == "1":
        @app.post("/debug/prompt_kv")
        async def debug_prompt_kv(body: dict[str, Any]) -> dict[str, Any]:
            """Test-only (PDSERVE_DEBUG_ROUTES=1): the cached KV bytes of a prompt's blocks."""
            await engine_alive()
            return {"blocks": await engine.debug_prompt_kv(list(body["prompt_token_ids"]))}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _version()}

    @app.get("/tokenizer_info")
    async def get_tokenizer_info() -> dict[str, Any]:
        return tokenizer_info(ctx.tokenizer, ctx.max_model_len)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            prompt = render_chat_prompt(
                ctx.tokenizer, [{"role": m.role, "content": m.text()} for m in body.messages],
                add_generation_prompt=body.add_generation_prompt)
            tokens = prompt["prompt_token_ids"]
        else:
            tokens = list(ctx.tokenizer.encode(body.prompt,
                                               add_special_tokens=body.add_special_tokens))
        return {"tokens": tokens, "count": len(tokens), "max_model_len": ctx.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        ctx.check_model(body.model)
        vocab = _vocab_size(ctx.tokenizer)
        bad = [t for t in body.tokens if vocab is not None and t >= vocab]
        if bad:
            raise APIError(f"tokens: token id {bad[0]} is out of vocabulary (size {vocab})",
                           param="tokens")
        return {"prompt": ctx.tokenizer.decode(body.tokens)}

    @app.get("/kv_transfer/info")
    async def kv_transfer_info() -> JSONResponse:
        info = settings.kv_transfer_info
        if info is None:
            raise APIError("this server has no kv-transfer config", 404, code="not_found")
        # what the worker halves bound wins over what was configured, at every DP rank
        bound = dict(await _maybe_await(engine.kv_transfer_info()) or {})
        bound_ranks = {r["rank"]: r for r in bound.pop("data_parallel_ranks", ())}
        info = {**info, **bound}
        if info.get("data_parallel_ranks"):  # a rank whose engine died is listed, not alive
            dead = set(engine.dead_data_parallel_ranks)
            info["data_parallel_ranks"] = [
                {**r, **bound_ranks.get(r["rank"], {}), "alive": r["rank"] not in dead}
                for r in info["data_parallel_ranks"]]
        return JSONResponse(info)

    return app


def _count_error(app: FastAPI, path: str, status: int) -> None:
    """One error response in `pdserve:http_request_errors_total`; a path the app does not
    serve is "other", so clients cannot grow the label set."""
    known = getattr(app.state, "route_paths", None)
    if known is None:
        known = app.state.route_paths = frozenset(getattr(r, "path", "") for r in app.routes)
    app.state.metrics.http_errors.labels(route=path if path in known else "other",
                                         status=str(status)).inc()


def _vocab_size(tokenizer: Any) -> int | None:
    for attr in ("vocab_size", "__len__"):
        value = getattr(tokenizer, attr, None)
        try:
            return int(value() if callable(value) else value)
        except (TypeError, ValueError):
            continue
    return None
