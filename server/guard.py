"""What stands between the network and the scheduler: `Guard`, a pure-ASGI middleware.

It sees every HTTP request before FastAPI does. On every path but the open ones (/health, /metrics when
configured open, the playground's page and files) it checks the API key (keys.py), takes one request from the
client's rate budget
(rate_limit.py), and reads the body itself so that an oversized one is refused while it arrives. Limits
on fields are the routes' (request_limits.py).
"""

from __future__ import annotations

import asyncio
import time

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .keys import ApiKeys
from .rate_limit import RateLimiter
from .schemas import APIError
from .settings import SecurityConfig


ADDRESS_PREFIX = "address:"  # a caller named by its address, where the server has no keys


class Guard:
    """ASGI middleware: API key, rate budget and body size on every path but the open ones: /health, /metrics
    when configured open, and `pages` (the playground's files, which hold no secrets; their API calls carry the key)."""

    def __init__(self, app: ASGIApp, settings: SecurityConfig, keys: ApiKeys, limiter: RateLimiter,
                 pages: frozenset[str] = frozenset()):
        self.app = app
        self.settings = settings
        self.keys = keys
        self.limiter = limiter
        # Everything else is guarded, not only /v1/*: FastAPI's /docs and unknown paths too.
        self.open_paths = {"/health"} | ({"/metrics"} if settings.metrics == "open" else set()) | pages

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        try:
            if scope["path"] == "/metrics" and self.settings.metrics == "port":
                raise APIError(404, "metrics are served on their own port (security.metrics_port)")
            client = self._client(scope)
            self.limiter.admit(client)
            body = await self._body(scope, receive)
        except APIError as error:
            response = JSONResponse(error.body(), status_code=error.status, headers=error.headers)
            return await response(scope, receive, send)
        if body is None:
            return  # the client left while sending: nobody to answer
        scope.setdefault("state", {})["client"] = client  # request.state.client, for MeteredJob
        await self.app(scope, _replay(body, receive), send)

    def _client(self, scope: Scope) -> str:
        """Who is asking: their key's short hash, or their address when the server has no keys."""
        address = f"{ADDRESS_PREFIX}{scope['client'][0] if scope.get('client') else 'unknown'}"
        if not self.keys:
            return address
        # Wrong keys spend the address's budget, so that keys cannot be guessed at network speed.
        self.limiter.admit(address, budgets=("wrong_keys",))
        client = self.keys.identify(_header(scope, b"authorization"))
        if client is None:
            self.limiter.charge(address, 1, "wrong_keys")
            message = "a valid API key is required: send it as 'Authorization: Bearer KEY'"
            if b"api_key=" in scope.get("query_string", b""):
                message += " (never in the URL, where logs and proxies keep it)"
            raise APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return client

    async def _body(self, scope: Scope, receive: Receive) -> bytes | None:
        """The whole body, refused with a 413 as soon as it is known to be too large, and with a 408 when
        it has not all arrived within body_timeout_s (a client must not hold a connection by sending
        nothing); None on disconnect."""
        limits = self.settings.limits
        declared = _header(scope, b"content-length")
        if declared is not None and int(declared) > limits.max_body_bytes:
            raise _too_large(int(declared), limits.max_body_bytes)
        deadline = time.monotonic() + limits.body_timeout_s
        # A chunked body (or one longer than declared) is counted as it arrives.
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0))
            except asyncio.TimeoutError:
                raise APIError(
                    408, f"the request body did not arrive within {limits.body_timeout_s:g} s "
                    "(security.limits.body_timeout_s); send the whole body at once",
                    code="body_timeout", headers={"Connection": "close"},
                ) from None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limits.max_body_bytes:
                raise _too_large(size, limits.max_body_bytes)
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)


def _too_large(size: int, limit: int) -> APIError:
    message = f"the request body is {size} bytes or more, above this server's limit of {limit}"
    return APIError(413, f"{message} (security.limits.max_body_bytes)", code="request_too_large")


def _header(scope: Scope, name: bytes) -> bytes | None:
    return next((value for key, value in scope["headers"] if key == name), None)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the already-read body once, then the client's own messages (its disconnect)."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed
