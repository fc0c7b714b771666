"""The proxy's FastAPI app: the two OpenAI POST routes, /v1/models, /health, /metrics, and
the engines' helper routes passed to a decode backend (proxy/passthrough.py).

Invariants: every client request gets either D's answer relayed as it arrives or an OpenAI
error body (with the request id in the message and in the `X-Request-Id` header); the
client's X-Request-Id is a trace label only (echoed, logged): both legs carry an id and a
transfer_id the proxy made for this request, so clients reusing ids cannot cross requests; every
request is counted in `pdserve:proxy_requests_total{route,status}` (499: the client left
before the response started). Everything runs on the event loop of the uvicorn server.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from engine.server.body_check import body_problem
from proxy.backends import DECODE, PREFILL, BackendPool, HealthMonitor
from proxy.config import ProxyConfig
from proxy.discovery import Membership, start_membership
from proxy.errors import ProxyError, error_body
from proxy.flow import ClientGone, Dispatcher, RequestContext
from proxy.kv_info import KVInfoCache
from proxy.kv_subscriber import EventSubscriber
from proxy.leg_client import LegClient
from proxy.legs import CHAT, COMPLETIONS, ROUTE_PATHS, decode, new_id
from proxy.metrics import CONTENT_TYPE, HopMiddleware, ProxyMetrics
from proxy.passthrough import GET_ROUTES, POST_ROUTES, from_decode
from proxy.relay import wait_for_disconnect
from proxy.routing import build_router

logger = logging.getLogger("pdserve.proxy")

# Below uvicorn's 5 s keep-alive timeout: a pooled connection is never reused just as the
# backend closes it (which would read as a connection failure of a healthy backend).
_KEEPALIVE_EXPIRY = 4.0
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


class ProxyState:
    """Pools, metrics and HTTP clients of one proxy. Clients exist between start() and stop()."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.metrics = ProxyMetrics()
        self.prefill = BackendPool(PREFILL, config.prefill_urls, self.metrics)
        self.decode = BackendPool(DECODE, config.decode_urls, self.metrics)
        self.backend_auth = (
            {"authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        )
        self.client: aiohttp.ClientSession | None = None
        self.p_client: LegClient | None = None
        self.control: httpx.AsyncClient | None = None
        self.dispatcher: Dispatcher | None = None
        self.health: HealthMonitor | None = None
        self.membership: Membership | None = None
        self.subscribers: list[EventSubscriber] = []

    async def start(self) -> None:
        c = self.config
        # legs get their own pool, so long streams can never starve health checks; aiohttp
        # (C HTTP parser) costs less per leg than httpx, on every request's TTFT
        self.client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=c.max_connections, limit_per_host=0,
                                           keepalive_timeout=_KEEPALIVE_EXPIRY),
            # sock_connect, not connect: aiohttp's `connect` also bounds the wait for a free
            # slot under max_connections, so a burst of legs beyond it failed as a connect
            # timeout (a 504, and a healthy backend counted as failing); the request's
            # deadline bounds that wait instead
            timeout=aiohttp.ClientTimeout(total=c.request_timeout,
                                          sock_connect=c.connect_timeout),
            headers={"accept-encoding": "identity"},
            auto_decompress=False,
        )
        self.p_client = LegClient(limit=c.max_connections, keepalive=_KEEPALIVE_EXPIRY,
                                  headers={"accept-encoding": "identity"})
        self.control = httpx.AsyncClient(
            timeout=httpx.Timeout(c.health_timeout),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=32,
                                keepalive_expiry=_KEEPALIVE_EXPIRY),
            trust_env=False,
        )
        kv_info = KVInfoCache(self.control, timeout=c.health_timeout, headers=self.backend_auth)
        self.prefill.on_transition(lambda backend: kv_info.invalidate(backend.url))
        self.router, self.subscribers = build_router(c, self.prefill, self.decode,
                                                     self.metrics.registry)
        for subscriber in self.subscribers:
            subscriber.start()
        self.dispatcher = Dispatcher(c, self.client, self.p_client, self.prefill, self.decode,
                                     kv_info, self.metrics, self.router)
        self.health = HealthMonitor([self.prefill, self.decode], self.control,
                                    interval=c.health_interval, timeout=c.health_timeout,
                                    headers=self.backend_auth)
        await self.health.check_once()
        self.health.start()
        if c.discovery:
            self.membership = start_membership(c, self.prefill, self.decode, self.health,
                                               self.metrics)
            await self.membership.start(first_sync_timeout=c.health_timeout)
        logger.info("proxy (%s mode) prefill=%s decode=%s", c.mode,
                    list(c.prefill_urls), list(c.decode_urls))

    async def stop(self) -> None:
        if self.membership is not None:
            await self.membership.stop()
        for subscriber in self.subscribers:
            await subscriber.stop()
        if self.health is not None:
            await self.health.stop()
        if self.dispatcher is not None:
            await self.dispatcher.shutdown()
        if self.client is not None:
            await self.client.close()
        if self.p_client is not None:
            await self.p_client.close()
        if self.control is not None:
            await self.control.aclose()

    # ---- request handling ---------------------------------------------------------------

    def authorize(self, request: Request, request_id: str) -> None:
        if not self.config.api_key:
            return
        given = request.headers.get("authorization", "")
        expected = f"Bearer {self.config.api_key}"
        if not hmac.compare_digest(given.encode(), expected.encode()):
            raise ProxyError(401, f"request {request_id}: missing or invalid API key "
                             "(send 'Authorization: Bearer <key>')", code="invalid_api_key")

    def leg_headers(self, request: Request, engine_request_id: str) -> dict[str, str]:
        """Headers for a backend call. `engine_request_id` is the proxy's own id, never the
        client's X-Request-Id (a label only): client ids never pair a P leg with a D leg."""
        headers = {"content-type": "application/json", "x-request-id": engine_request_id}
        if self.config.api_key:
            headers.update(self.backend_auth)
        elif "authorization" in request.headers:
            headers["authorization"] = request.headers["authorization"]
        return headers

    async def generate(self, request: Request, route: str) -> Response:
        started = time.monotonic()
        request_id = _request_id(request)
        engine_request_id = new_id()
        try:
            self.authorize(request, request_id)
            body = await _read_json_body(request, self.config.max_body_bytes, request_id)
            assert self.dispatcher is not None, "proxy not started"
            ctx = RequestContext(
                route=route,
                path=ROUTE_PATHS[route],
                body=body,
                headers=self.leg_headers(request, engine_request_id),
                request_id=request_id,
                engine_request_id=engine_request_id,
                started=started,
                deadline=started + self.config.request_timeout,
                disconnect=asyncio.ensure_future(wait_for_disconnect(request.receive)),
            )
            try:
                response = await self.dispatcher.dispatch(ctx)
            finally:
                ctx.disconnect.cancel()
        except ProxyError as err:
            if err.status >= 500:
                logger.warning("%s", err.message)
            response = err.response(headers={"x-request-id": request_id})
        except ClientGone:
            response = Response(status_code=499)
        except Exception as exc:  # a bug: still an answer, and still counted
            logger.exception("request %s: unexpected proxy error", request_id)
            response = ProxyError(500, f"request {request_id}: internal proxy error: "
                                  f"{type(exc).__name__}").response(
                                      headers={"x-request-id": request_id})
        self.metrics.requests.labels(route=ROUTE_PATHS[route],
                                     status=str(response.status_code)).inc()
        return response

    async def models(self, request: Request) -> Response:
        request_id = _request_id(request)
        route = "/v1/models"
        try:
            self.authorize(request, request_id)
            response = await self._models_from_decode(request, request_id)
        except ProxyError as err:
            response = err.response(headers={"x-request-id": request_id})
        self.metrics.requests.labels(route=route, status=str(response.status_code)).inc()
        return response

    async def _models_from_decode(self, request: Request, request_id: str) -> Response:
        assert self.control is not None, "proxy not started"
        return await from_decode(self.control, self.decode, self.leg_headers(request, new_id()),
                                 request_id, "/v1/models", None)

    def health_report(self, request: Request) -> JSONResponse:
        """200 while both roles have a backend in rotation, else 503. The backends (URLs,
        load, last errors) are listed only to callers with the API key (or when there is
        none): an anonymous caller learns the status and nothing of the deployment."""
        missing = [p.role for p in (self.prefill, self.decode) if not p.healthy()]
        status = {"status": "unavailable" if missing else "ok"}
        if missing:
            status.update(error_body("no healthy backend" if self._anonymous(request) else
                                     f"no healthy {' or '.join(missing)} backend", 503,
                                     code="no_healthy_backend"))
        if not self._anonymous(request):
            status.update(mode=self.config.mode, prefill=_describe(self.prefill),
                          decode=_describe(self.decode))
        return JSONResponse(status, status_code=503 if missing else 200)

    def _anonymous(self, request: Request) -> bool:
        try:
            self.authorize(request, "")
        except ProxyError:
            return True
        return False


def _describe(pool: BackendPool) -> list[dict[str, Any]]:
    return [{"url": b.url, "healthy": b.healthy, "outstanding": b.outstanding,
             "last_error": b.last_error} for b in pool.backends]


def _request_id(request: Request) -> str:
    """The client's X-Request-Id when it is a sane label, else a fresh one: echoed to the
    client and written in logs and error messages, never sent to an engine."""
    given = request.headers.get("x-request-id", "")
    return given if _REQUEST_ID.match(given) else new_id()


async def _read_json_body(request: Request, limit: int, request_id: str) -> dict[str, Any]:
    too_large = ProxyError(413, f"request {request_id}: body larger than {limit} bytes",
                           code="request_too_large")
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise ProxyError(400, f"request {request_id}: bad Content-Length {length!r}")
        if int(length) > limit:
            raise too_large
    buf = bytearray()
    try:
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > limit:
                raise too_large
    except ClientDisconnect:
        raise ClientGone(request_id) from None
    if not buf.strip():
        raise ProxyError(400, f"request {request_id}: the request needs a JSON body")
    try:
        body = decode(buf)
    except ValueError as exc:
        raise ProxyError(400, f"request {request_id}: malformed JSON body: {exc}") from None
    except RecursionError:
        raise ProxyError(400, f"request {request_id}: malformed JSON body: nested too "
                         "deeply") from None
    if not isinstance(body, dict):
        raise ProxyError(400, f"request {request_id}: the request body must be a JSON object")
    problem = body_problem(body)  # the engines judge the same; no leg for a hostile body
    if problem is not None:
        path, what = problem
        raise ProxyError(400, f"request {request_id}: {path}: {what}", param=path)
    return body


def _passing(state: ProxyState, path: str) -> Any:
    """The route answering `path` from a decode backend, counted like the others."""

    async def route(request: Request) -> Response:
        request_id = _request_id(request)
        try:
            state.authorize(request, request_id)
            body = None
            if path in POST_ROUTES:
                body = await _read_json_body(request, state.config.max_body_bytes, request_id)
            assert state.control is not None, "proxy not started"
            response = await from_decode(state.control, state.decode,
                                         state.leg_headers(request, new_id()), request_id,
                                         path, body)
        except ProxyError as err:
            response = err.response(headers={"x-request-id": request_id})
        except ClientGone:
            response = Response(status_code=499)
        state.metrics.requests.labels(route=path, status=str(response.status_code)).inc()
        return response

    return route


class ProxyApp(FastAPI):
    """FastAPI for every route but the two generation POSTs, which go straight to the proxy
    (with the hop clock): under FastAPI's middleware stack every relayed chunk passed through
    four send wrappers, a fifth of the relay's CPU under load (issue 33). ProxyState.generate
    answers every error itself; what escapes it is uvicorn's to report, as it was Starlette's."""

    hot: dict[str, Any]  # path -> the ASGI app serving it

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        hot = self.hot.get(scope["path"]) if scope["type"] == "http" else None
        if hot is not None and scope["method"] == "POST":
            scope["app"] = self
            await hot(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def _generation(state: ProxyState, route: str) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        response = await state.generate(Request(scope, receive, send), route)
        await response(scope, receive, send)

    return HopMiddleware(app, metrics=state.metrics)  # pdserve:proxy_hop_seconds


def build_app(config: ProxyConfig) -> FastAPI:
    state = ProxyState(config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = ProxyApp(title="pdserve proxy", lifespan=lifespan,
                   docs_url=None, redoc_url=None, openapi_url=None)
    app.state.proxy = state
    app.hot = {ROUTE_PATHS[route]: _generation(state, route) for route in (COMPLETIONS, CHAT)}
    for path, hot in app.hot.items():  # ProxyApp serves their POSTs; the routes give the
        app.add_route(path, hot, methods=["POST"])  # other methods Starlette's 405

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await state.models(request)

    @app.get("/health")
    async def health(request: Request) -> Response:
        return state.health_report(request)

    for path in GET_ROUTES:  # the engines' helper routes, answered by a decode backend
        app.add_api_route(path, _passing(state, path), methods=["GET"])
    for path in POST_ROUTES:
        app.add_api_route(path, _passing(state, path), methods=["POST"])

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if not config.public_metrics:
            try:
                state.authorize(request, _request_id(request))
            except ProxyError as err:
                return err.response()
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "error"
        return JSONResponse(error_body(message, exc.status_code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"internal proxy error: {type(exc).__name__}", 500),
                            status_code=500)

    return app
