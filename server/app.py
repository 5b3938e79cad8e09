"""The FastAPI app and `serve`: models load in the worker thread while /health answers 503."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from prometheus_client import start_http_server
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from specdec_core.build import build_engine

from .guard import Guard
from .keys import ApiKeys, load_keys
from .metrics import Metrics, RequestCounter
from .rate_limit import RateLimiter
from .routes import PLAYGROUND_PATHS, router
from .scheduler import Scheduler
from .schemas import APIError, internal_error, validation_error
from .settings import ServeConfig, ServerConfig

log = logging.getLogger("specdec.server")


def create_app(config: ServeConfig, drafter: str | None = None) -> FastAPI:
    """An app serving `config`'s target (with `drafter` overriding the config's); models load on startup."""
    metrics = Metrics()
    scheduler = Scheduler(lambda: build_engine(config, drafter=drafter), config.server, metrics, config.grammar)
    security = config.security
    keys = ApiKeys(load_keys(security))
    log.info("API keys: %d%s", len(keys), "" if keys else " (the API is open to all who reach it)")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        if security.metrics == "port":
            app.state.metrics_listener, _ = start_http_server(security.metrics_port, config.server.host, metrics.registry)
        yield
        await asyncio.to_thread(scheduler.shutdown)
        if security.metrics == "port":  # after the drain, which is worth watching
            app.state.metrics_listener.shutdown()
            app.state.metrics_listener.server_close()

    app = FastAPI(title="specdec", lifespan=lifespan)
    app.openapi = _openapi(app)
    access_log = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactQuery) for f in access_log.filters):
        access_log.addFilter(RedactQuery())
    app.state.scheduler = scheduler
    app.state.metrics = metrics
    app.state.model_name = config.server.served_model_name or config.model.target
    app.state.created = int(time.time())
    app.state.limits = security.limits
    app.state.limiter = RateLimiter(security.rate_limit, metrics)
    app.state.playground = config.server.playground
    app.include_router(router)
    # The last added runs first: CORS answers preflights before the guard asks them for a key (and
    # adds its headers to the guard's refusals); the counter sees the guard's 401, 413 and 429.
    pages = PLAYGROUND_PATHS if config.server.playground else frozenset()
    app.add_middleware(Guard, settings=security, keys=keys, limiter=app.state.limiter, pages=pages)
    app.add_middleware(RequestCounter, metrics=metrics)
    if security.cors_origins:
        # Any header: the origin is the check; keys travel in a header, never in cookies (no credentials).
        app.add_middleware(
            CORSMiddleware, allow_origins=security.cors_origins, allow_methods=["GET", "POST"], allow_headers=["*"],
            expose_headers=[REPLICA_HEADER],
        )
    app.add_middleware(NameReplica, name=config.server.replica_name or socket.gethostname())
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
    return app


REPLICA_HEADER = "X-Specdec-Replica"


class NameReplica:
    """Every response names the replica that answered (REPLICA_HEADER), refusals too, so that routing behind a
    load balancer can be counted."""

    def __init__(self, app: ASGIApp, name: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.lower().encode(), name.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), self.header]
            await send(message)

        await self.app(scope, receive, named)


def _respond(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return _respond(exc)


async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    return _respond(validation_error(list(exc.errors())))


# FastAPI's words for a body it could not decode (not UTF-8, nested too deeply) say nothing of why.
_UNPARSED_BODY = "There was an error parsing the body"


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    message = str(exc.detail)
    if message == _UNPARSED_BODY:
        message = "the request body could not be parsed: send one JSON object, UTF-8 encoded, nested at most a few levels"
    # Starlette's own headers stay: a 405's Allow names the methods the path takes.
    return _respond(APIError(exc.status_code, message, type=kind, headers=exc.headers))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    # Starlette re-raises the exception after this response, and uvicorn logs its traceback.
    return _respond(internal_error(f"{request.method} {request.url.path} failed", exc))


def _openapi(app: FastAPI) -> Callable[[], dict]:
    """FastAPI's schema without the 422 it adds to every route with a body: a bad body gets our 400."""

    def schema() -> dict:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for operations in spec["paths"].values():
                for operation in operations.values():
                    operation["responses"].pop("422", None)
            for unused in ("HTTPValidationError", "ValidationError"):
                spec.get("components", {}).get("schemas", {}).pop(unused, None)
            app.openapi_schema = spec
        return app.openapi_schema

    return schema


class JsonErrorH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, answering a request it cannot parse (a malformed Content-Length,
    say) with the OpenAI error shape instead of plain text."""

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(APIError(400, f"{msg} Check the request line and headers (Content-Length).").body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


class RedactQuery(logging.Filter):
    """Access-log lines without query strings: the API takes none, so one is a mistake, and may be
    a key sent as ?api_key=."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and len(record.args) == 5 and "?" in str(record.args[2]):
            client, method, path, version, status = record.args
            record.args = (client, method, path.split("?", 1)[0] + "?[query redacted]", version, status)
        return True


def server_config(app: FastAPI, settings: ServerConfig, **options: object) -> uvicorn.Config:
    """uvicorn's settings for the app: our protocol, and a shutdown backstop past the drain."""
    return uvicorn.Config(
        app,
        http=JsonErrorH11Protocol,
        # A backstop only: the scheduler itself ends in-flight requests once the grace is over.
        timeout_graceful_shutdown=int(settings.shutdown_grace_s) + 10,
        **options,
    )


class DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the scheduler at SIGTERM/SIGINT so that it stops admitting at once
    and ends what is still running after shutdown_grace_s (uvicorn itself waits for open requests).
    The listener stays open for drain_listen_s first, so that load balancers see /health's 503
    rather than refused connections; a second signal closes it at once."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler):
        super().__init__(config)
        self.scheduler = scheduler
        self._closing: threading.Timer | None = None

    def handle_exit(self, sig: int, frame) -> None:
        serving = self.scheduler.state == "ready"
        self.scheduler.drain(self.scheduler.settings.shutdown_grace_s)
        listen_s = self.scheduler.settings.drain_listen_s
        if serving and listen_s > 0 and self._closing is None:
            log.info("draining: new requests get 503; the listener closes in %.0f s", listen_s)
            self._closing = threading.Timer(listen_s, super().handle_exit, (sig, frame))
            self._closing.daemon = True
            self._closing.start()
        else:
            super().handle_exit(sig, frame)


def serve(config_path: str, host: str | None = None, port: int | None = None, drafter: str | None = None) -> int:
    """Run the server until SIGTERM/SIGINT; 0 on a clean exit, 1 when the models failed to load."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ServeConfig.load(config_path)
    app = create_app(config, drafter=drafter)
    scheduler: Scheduler = app.state.scheduler
    settings = config.server
    server = DrainingServer(server_config(app, settings, host=host or settings.host, port=port or settings.port), scheduler)
    scheduler.on_load_error = lambda: server.handle_exit(signal.SIGTERM, None)
    # uvicorn re-raises the signal that stopped it once shutdown is over; by then the drain
    # is done, so the process should end with serve's status rather than die by that signal.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    server.run()
    return 1 if scheduler.state == "failed" else 0
