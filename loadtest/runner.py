"""Sending the load: one streamed request, one level of a sweep, a whole sweep over targets.

Every loop here is bounded twice: a level sends at most `requests` requests
and starts none after `duration_s`; each request gives up after `timeout_s`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import random
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .report import percentiles, ratio_or_none


@dataclass(frozen=True)
class Target:
    label: str
    url: str  # base URL, no trailing slash


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds from sending it."""

    ok: bool
    e2e: float
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)  # gaps between consecutive content events (one per token)
    output_tokens: int = 0
    prompt_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    error: str | None = None  # "HTTP 429: ...", "stream: ...", "ReadTimeout: ..."


@dataclass(frozen=True)
class Load:
    """What one level sends: `concurrency` users back to back, or arrivals at `rate` per second."""

    mode: Literal["concurrency", "rate"]
    level: float
    requests: int
    duration_s: float


def summarize(
    label: str, load: Load, results: Sequence[RequestResult], wall_s: float, before: dict[str, float], after: dict[str, float]
) -> dict:
    """One level on one target: counts, latency percentiles, throughput, and the server's own view."""
    ok = [r for r in results if r.ok]
    drafted = sum(r.draft_tokens for r in ok)
    delta = {key: after[key] - before.get(key, 0.0) for key in after}
    steps = {mode: delta.get(f"specdec_decode_steps_total:{mode}", 0.0) for mode in ("speculative", "plain")}
    return {
        "target": label,
        "mode": load.mode,
        "level": load.level,
        "sent": len(results),
        "ok": len(ok),
        "errors": dict(Counter(r.error.split(":")[0] for r in results if not r.ok)),
        "wall_s": wall_s,
        "ttft_s": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "itl_s": percentiles([gap for r in ok for gap in r.itls]),
        "e2e_s": percentiles([r.e2e for r in ok]),
        "output_tokens": sum(r.output_tokens for r in ok),
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / wall_s if wall_s else 0.0,
        "acceptance_rate": sum(r.accepted_tokens for r in ok) / drafted if drafted else None,
        # From the server's /metrics, differenced over the level (None if it exposes none).
        "mean_batch_size": ratio_or_none(delta.get("specdec_batch_size_sum"), delta.get("specdec_batch_size_count")),
        "speculative_step_share": ratio_or_none(steps["speculative"], steps["speculative"] + steps["plain"]),
    }


@dataclass(frozen=True)
class LevelPrompts:
    """The prompts each level sends: a slice of the file's order no earlier level (or run with a smaller offset) sent.

    A server's drafter may remember its own earlier answers (the suffix drafter does), so a prompt sent twice
    measures that memory rather than the server: each level gets fresh prompts, and a run that had to wrap
    around the file says how many it repeated.
    """

    per_level: list[list[str]]
    next_offset: int  # where a later run on the same server starts to send only new prompts
    repeated: int  # requests whose prompt an earlier level or run (from offset 0) already sent

    def summary(self) -> str:
        if self.repeated:
            return (f"**{self.repeated} requests repeated a prompt** that an earlier level (or run) sent: the file "
                    f"has too few prompts for this sweep; a server that remembers its answers drafts them.")
        return (f"Every level sent prompts no earlier level sent (a later run on the same server: "
                f"`--prompt-offset {self.next_offset}`).")


def level_prompts(pool: Sequence[str], levels: int, requests: int, offset: int) -> LevelPrompts:
    """`requests` prompts for each of `levels` levels, in order from `offset` into `pool` (wrapping if it runs out)."""
    if not pool:
        raise ValueError("the prompts file holds no prompts")
    end = offset + levels * requests
    order = [pool[i % len(pool)] for i in range(offset, end)]
    # Every request past the file's end repeats one (from where this run started past it, if it did).
    return LevelPrompts([order[i * requests:(i + 1) * requests] for i in range(levels)], end,
                        max(0, end - max(offset, len(pool))))


def parse_target(text: str) -> Target:
    """`LABEL=URL` or a bare URL (labelled host:port); only loopback hosts are accepted."""
    label, _, url = text.rpartition("=") if "=" in text.split("://")[0] else ("", "", text)
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s) URL")
    require_loopback(parts.hostname)
    return Target(label or parts.netloc, url.rstrip("/"))


def require_loopback(host: str) -> None:
    """Load only ever goes to this machine: every address the host resolves to must be loopback."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror as exc:
        raise ValueError(f"cannot resolve {host!r}: {exc}") from exc
    others = sorted(a for a in addresses if not ipaddress.ip_address(a.split("%")[0]).is_loopback)
    if others:
        raise ValueError(f"{host!r} resolves to non-loopback addresses {others}; the load generator only targets loopback")


async def stream_chat(
    client: httpx.AsyncClient, target: Target, body: dict, timeout_s: float, on_token: Callable[[], None] | None = None,
) -> RequestResult:
    """Send one streamed chat completion and time its tokens (`on_token` is called as each arrives)."""
    start = time.perf_counter()
    token_times: list[float] = []
    usage: dict = {}
    timings: dict = {}  # llama-server's own figures, beside its usage

    def failed(error: str) -> RequestResult:
        return RequestResult(False, time.perf_counter() - start, error=error)

    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", f"{target.url}/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    return failed(f"HTTP {response.status_code}: {_error_message(await response.aread())}")
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:  # the server failed the request after the headers went out
                        return failed(f"stream: {chunk['error'].get('message')}")
                    usage = chunk.get("usage") or usage
                    timings = chunk.get("timings") or timings
                    if any(choice["delta"].get("content") for choice in chunk.get("choices", ())):
                        token_times.append(time.perf_counter())
                        if on_token:
                            on_token()
    except (httpx.HTTPError, TimeoutError, json.JSONDecodeError) as exc:
        return failed(f"{type(exc).__name__}: {exc}")
    if not usage:
        return failed("stream ended without usage")
    # Ours report drafts in usage.speculative, llama-server in its timings (where it drafted at all).
    spec = usage.get("speculative") or {"draft_tokens": timings.get("draft_n", 0),
                                        "accepted_tokens": timings.get("draft_n_accepted", 0)}
    return RequestResult(
        ok=True,
        e2e=time.perf_counter() - start,
        ttft=token_times[0] - start if token_times else None,
        itls=[b - a for a, b in zip(token_times, token_times[1:])],
        output_tokens=usage["completion_tokens"],
        prompt_tokens=usage["prompt_tokens"],
        draft_tokens=spec.get("draft_tokens", 0),
        accepted_tokens=spec.get("accepted_tokens", 0),
    )


def _error_message(raw: bytes) -> str:
    try:
        return json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode(errors="replace")


async def run_level(send: Callable[[], Awaitable[RequestResult]], load: Load) -> tuple[list[RequestResult], float]:
    """Drive one level; returns the results and the level's wall time."""
    start = time.perf_counter()
    deadline = start + load.duration_s
    results: list[RequestResult] = []
    if load.mode == "concurrency":
        issued = 0

        async def user() -> None:
            nonlocal issued
            while issued < load.requests and time.perf_counter() < deadline:
                issued += 1  # claimed before awaiting: the event loop is the only writer
                results.append(await send())

        await asyncio.gather(*(user() for _ in range(int(load.level))))
    else:
        # Open loop: Poisson arrivals, whatever the server's pace; seeded so runs compare.
        arrivals = random.Random(0)
        tasks = []
        for _ in range(load.requests):
            if time.perf_counter() >= deadline:
                break
            tasks.append(asyncio.create_task(send()))
            await asyncio.sleep(arrivals.expovariate(load.level))
        results = list(await asyncio.gather(*tasks))
    return results, time.perf_counter() - start


def scrape(client: httpx.Client, target: Target) -> dict[str, float]:
    """The server's counters that tell batching and decode mode apart (empty if it has no /metrics)."""
    response = client.get(f"{target.url}/metrics")
    if response.status_code != 200:
        return {}
    wanted = {"specdec_batch_size_sum", "specdec_batch_size_count", "specdec_decode_steps_total"}
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name in wanted:
                key = sample.name + "".join(f":{v}" for v in sample.labels.values())
                values[key] = values.get(key, 0.0) + sample.value
    return values


def model_of(client: httpx.Client, target: Target) -> str:
    """The served model's name; fails clearly if the server is not ready or refuses us (a missing API key)."""
    for path in ("/health", "/v1/models"):
        response = client.get(f"{target.url}{path}")
        if response.status_code != 200:
            raise RuntimeError(f"{target.label} ({target.url}): {path} answered {response.status_code}: "
                               f"{_error_message(response.content)}")
    return response.json()["data"][0]["id"]


async def sweep(
    targets: Sequence[Target],
    loads: Sequence[Load],
    prompts: Sequence[Sequence[str]],
    max_tokens: int,
    temperature: float,
    timeout_s: float,
    api_key: str | None = None,
    on_level: Callable[[dict], None] = lambda level: None,
) -> list[dict]:
    """Each level on each target in turn: targets interleaved per level, so that drift hits all alike;
    `prompts[i]` are level i's (at least its requests), the same for each target and in the same order."""
    if len(prompts) != len(loads) or any(len(texts) < load.requests for texts, load in zip(prompts, loads)):
        raise ValueError("sweep needs one list of prompts per level, each with at least that level's requests")
    levels = []
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # One connection per in-flight request: the pool must not queue requests on the client side. None kept
    # alive: llama-server closes a connection a moment after its response, and a request sent on it fails.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    with httpx.Client(timeout=30, headers=headers, limits=limits) as sync:
        models = {t.label: model_of(sync, t) for t in targets}
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits, headers=headers) as client:
            for load, level_texts in zip(loads, prompts):
                for target in targets:
                    texts = iter(level_texts)

                    def send(target: Target = target) -> Awaitable[RequestResult]:
                        body = {
                            "model": models[target.label],
                            "messages": [{"role": "user", "content": next(texts)}],
                            "max_tokens": max_tokens,
                            "temperature": temperature,
                            "stream": True,
                            "stream_options": {"include_usage": True},
                        }
                        return stream_chat(client, target, body, timeout_s)

                    before = scrape(sync, target)
                    results, wall = await run_level(send, load)
                    levels.append(summarize(target.label, load, results, wall, before, scrape(sync, target)))
                    on_level(levels[-1])
    return levels
