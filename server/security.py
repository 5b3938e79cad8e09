"""What stands between the network and the scheduler: API keys, size limits, rate limits.

`Guard`, a pure-ASGI middleware, sees every HTTP request before FastAPI does.
On every path but the open ones (/health, and /metrics when configured open)
it checks the API key, takes one request from the client's rate budget, and
reads the body itself so that an oversized one is refused while it arrives.
Limits on fields need the parsed request and the tokenized prompt, so the
routes call `check_request` and `check_prompt_tokens`; a `MeteredJob` charges
the tokens it delivers to its client's token budget.

A client is named by a short hash of its key, or by its address when no keys
are configured; keys themselves are never logged or used as labels.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import math
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specdec_core.config import LimitsConfig, RateLimitConfig, SecurityConfig

from .metrics import Metrics
from .scheduler import Choice, Job, Update
from .schemas import APIError, ChatRequest, CompletionRequest, prompt_items

API_KEY_ENV = "SPECDEC_API_KEY"
MINUTE_S = 60.0  # budgets are per minute: a spent one refills fully in this long
FORGET_AFTER = 4096  # clients remembered before those with full budgets are forgotten
BUDGET_WORDS = {"requests": "requests", "tokens": "generated tokens", "wrong_keys": "wrong API keys from this address"}


def load_keys(settings: SecurityConfig) -> list[str]:
    """The accepted keys: `api_keys`, the lines of `api_key_file` (# starts a comment), and $SPECDEC_API_KEY."""
    keys = list(settings.api_keys)
    if settings.api_key_file:
        keys += [line.split("#", 1)[0] for line in Path(settings.api_key_file).read_text().splitlines()]
    keys.append(os.environ.get(API_KEY_ENV, ""))
    # An empty key would let `Authorization: Bearer ` in; blank lines and an unset variable are not keys.
    return [key.strip() for key in keys if key.strip()]


class ApiKeys:
    """The accepted keys, kept only as SHA-256 digests."""

    def __init__(self, keys: list[str]):
        self._digests = [hashlib.sha256(key.encode()).digest() for key in set(keys)]

    def __len__(self) -> int:
        return len(self._digests)

    def identify(self, authorization: bytes | None) -> str | None:
        """The short hash naming the key in an `Authorization: Bearer KEY` header; None if missing or unknown."""
        scheme, _, token = (authorization or b"").partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            return None
        # Comparing digests makes every comparison the same length, and no early exit means the
        # time taken says nothing about which key, or how much of one, matched.
        given = hashlib.sha256(token.strip()).digest()
        matched = [digest for digest in self._digests if hmac.compare_digest(given, digest)]
        return f"key:{matched[0].hex()[:8]}" if matched else None


@dataclass
class Bucket:
    """A token bucket holding up to per_minute, refilling at per_minute per minute; it may run into debt."""

    per_minute: int
    level: float
    at: float

    def fill(self, now: float) -> float:
        self.level = min(self.per_minute, self.level + (now - self.at) * self.per_minute / MINUTE_S)
        self.at = now
        return self.level


class RateLimiter:
    """Per-client budgets of requests and generated tokens. Used only on the event loop, so unlocked."""

    def __init__(self, settings: RateLimitConfig, metrics: Metrics):
        self.clock = time.monotonic  # tests replace it to move time without waiting
        self.metrics = metrics
        limits = {
            "requests": settings.requests_per_minute,
            "tokens": settings.tokens_per_minute,
            "wrong_keys": settings.wrong_keys_per_minute,
        }
        self._limits = {reason: limit for reason, limit in limits.items() if limit is not None}
        self._clients: dict[str, dict[str, Bucket]] = {}
        self._forget_at = FORGET_AFTER

    def admit(self, client: str, budgets: tuple[str, ...] = ("requests", "tokens")) -> None:
        """Take one request from the client's budget; a 429 with Retry-After while any of `budgets` is spent."""
        now = self.clock()
        buckets = self._buckets(client, now)
        for reason in budgets:
            bucket = buckets.get(reason)
            level = bucket.fill(now) if bucket else 1
            if level < 1:
                self.metrics.rate_limited.labels(reason).inc()
                wait_s = math.ceil((1 - level) * MINUTE_S / bucket.per_minute)
                raise APIError(
                    429,
                    f"rate limit reached: {bucket.per_minute} {BUDGET_WORDS[reason]} per minute "
                    f"(security.rate_limit.{reason}_per_minute); retry in {wait_s} s",
                    type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": str(wait_s)},
                )
        if "requests" in budgets and "requests" in buckets:
            buckets["requests"].level -= 1

    def charge(self, client: str, amount: int, budget: str = "tokens") -> None:
        """Take from the client's budget, into debt if need be: admit refuses until it refills."""
        now = self.clock()
        bucket = self._buckets(client, now).get(budget)
        if bucket is not None:
            bucket.fill(now)
            bucket.level -= amount

    def _buckets(self, client: str, now: float) -> dict[str, Bucket]:
        if client not in self._clients:
            if len(self._clients) >= self._forget_at:
                # A client whose budgets have refilled is no different from a new one: forget it,
                # so that many addresses cannot grow this without bound.
                self._clients = {
                    name: buckets for name, buckets in self._clients.items()
                    if any(bucket.fill(now) < bucket.per_minute for bucket in buckets.values())
                }
                self._forget_at = max(FORGET_AFTER, 2 * len(self._clients))
            self._clients[client] = {reason: Bucket(limit, limit, now) for reason, limit in self._limits.items()}
        return self._clients[client]


class MeteredJob(Job):
    """A job whose delivered tokens are charged to its client's token budget as the route reads them."""

    def __init__(self, choices: list[Choice], limiter: RateLimiter, client: str):
        super().__init__(choices)
        self.limiter = limiter
        self.client = client

    async def updates(self) -> AsyncIterator[Update]:
        async for update in super().updates():
            self.limiter.charge(self.client, len(update.tokens))
            yield update


def _at_most(limits: LimitsConfig, setting: str, value: int, param: str, what: str | None = None) -> None:
    """A 400 naming the limit `setting` of security.limits when value is above it."""
    limit = getattr(limits, setting)
    if value > limit:
        raise APIError(
            400, f"{what or param} is {value}, above this server's limit of {limit} (security.limits.{setting})",
            param=param, code="limit_exceeded",
        )


def check_request(limits: LimitsConfig, body: CompletionRequest | ChatRequest) -> None:
    """Refuse the first field of the request that is past its limit."""
    _at_most(limits, "max_n", body.n, "n")
    prompts = len(prompt_items(body.prompt)) if isinstance(body, CompletionRequest) else 1
    # Each sequence costs memory and batch slots: prompts x n is the request's share of the server.
    _at_most(limits, "max_sequences", prompts * body.n, "n" if prompts == 1 else "prompt",
             f"the number of sequences asked for ({prompts} prompts x n = {body.n})")
    _at_most(limits, "max_stop", len(body.stop), "stop", "the number of stop strings")
    _at_most(limits, "max_stop_length", max(map(len, body.stop), default=0), "stop", "the longest stop string's length")
    _at_most(limits, "max_logit_bias", len(body.logit_bias), "logit_bias", "the number of logit_bias entries")
    if isinstance(body, ChatRequest):
        _at_most(limits, "max_messages", len(body.messages), "messages", "the number of messages")
        _at_most(limits, "max_top_logprobs", body.top_logprobs or 0, "top_logprobs")
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        _at_most(limits, "max_tokens", body.max_completion_tokens or body.max_tokens or 0, param)
    else:
        _at_most(limits, "max_top_logprobs", body.logprobs or 0, "logprobs")
        _at_most(limits, "max_tokens", body.max_tokens, "max_tokens")


def check_prompt_tokens(limits: LimitsConfig, tokens: int, param: str) -> None:
    _at_most(limits, "max_prompt_tokens", tokens, param, "the number of prompt tokens")


class Guard:
    """ASGI middleware: API key, rate budget and body size on every path but the open ones."""

    def __init__(self, app: ASGIApp, settings: SecurityConfig, keys: ApiKeys, limiter: RateLimiter):
        self.app = app
        self.settings = settings
        self.keys = keys
        self.limiter = limiter
        # Everything else is guarded, not only /v1/*: FastAPI's /docs and unknown paths too.
        self.open_paths = {"/health"} | ({"/metrics"} if settings.metrics == "open" else set())

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
        address = f"address:{scope['client'][0] if scope.get('client') else 'unknown'}"
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
