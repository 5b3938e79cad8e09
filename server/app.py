"""The FastAPI app and `serve`: models load in the worker thread while /health answers 503."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import start_http_server
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from specdec_core.build import build_engine
from specdec_core.config import Config

from .metrics import Metrics, RequestCounter
from .routes import router
from .scheduler import Scheduler
from .schemas import APIError, validation_error
from .security import ApiKeys, Guard, RateLimiter, load_keys

log = logging.getLogger("specdec.server")


def create_app(config: Config, drafter: str | None = None) -> FastAPI:
    """An app serving `config`'s target (with `drafter` overriding the config's); models load on startup."""
    metrics = Metrics()
    scheduler = Scheduler(lambda: build_engine(config, drafter=drafter), config.server, metrics)
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
    app.state.scheduler = scheduler
    app.state.metrics = metrics
    app.state.model_name = config.server.served_model_name or config.model.target
    app.state.created = int(time.time())
    app.state.limits = security.limits
    app.state.limiter = RateLimiter(security.rate_limit, metrics)
    app.include_router(router)
    # The last added runs first: CORS answers preflights before the guard asks them for a key (and
    # adds its headers to the guard's refusals); the counter sees the guard's 401, 413 and 429.
    app.add_middleware(Guard, settings=security, keys=keys, limiter=app.state.limiter)
    app.add_middleware(RequestCounter, metrics=metrics)
    if security.cors_origins:
        # Any header: the origin is the check; keys travel in a header, never in cookies (no credentials).
        app.add_middleware(
            CORSMiddleware, allow_origins=security.cors_origins, allow_methods=["GET", "POST"], allow_headers=["*"]
        )
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
    return app


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
    return _respond(APIError(exc.status_code, message, type=kind))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    # Starlette re-raises the exception after this response, and uvicorn logs its traceback.
    return _respond(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))


class DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the scheduler at SIGTERM/SIGINT so that it stops admitting at once
    and ends what is still running after shutdown_grace_s (uvicorn itself waits for open requests)."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler):
        super().__init__(config)
        self.scheduler = scheduler

    def handle_exit(self, sig: int, frame) -> None:
        self.scheduler.drain(self.scheduler.settings.shutdown_grace_s)
        super().handle_exit(sig, frame)


def serve(config_path: str, host: str | None = None, port: int | None = None, drafter: str | None = None) -> int:
    """Run the server until SIGTERM/SIGINT; 0 on a clean exit, 1 when the models failed to load."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = Config.load(config_path)
    app = create_app(config, drafter=drafter)
    scheduler: Scheduler = app.state.scheduler
    settings = config.server
    server = DrainingServer(
        uvicorn.Config(
            app,
            host=host or settings.host,
            port=port or settings.port,
            # A backstop only: the scheduler itself ends in-flight requests once the grace is over.
            timeout_graceful_shutdown=int(settings.shutdown_grace_s) + 10,
        ),
        scheduler,
    )
    scheduler.on_load_error = lambda: server.handle_exit(signal.SIGTERM, None)
    # uvicorn re-raises the signal that stopped it once shutdown is over; by then the drain
    # is done, so the process should end with serve's status rather than die by that signal.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    server.run()
    return 1 if scheduler.state == "failed" else 0
