"""Per-client rate budgets (requests, generated tokens, wrong keys), refilled continuously per minute;
`MeteredJob` charges the tokens a job delivers to its client's token budget."""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from .metrics import Metrics
from .scheduler import Choice, Job, Update
from .schemas import APIError
from .settings import RateLimitConfig

MINUTE_S = 60.0  # budgets are per minute: a spent one refills fully in this long
FORGET_AFTER = 4096  # clients remembered before those with full budgets are forgotten
BUDGET_WORDS = {"requests": "requests", "tokens": "generated tokens", "wrong_keys": "wrong API keys from this address"}


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
