"""Prometheus metrics (names from DESIGN.md), in a registry of the app's own.

Everything here is measured: the worker feeds each engine step's report and
each request's token timings; a pure-ASGI middleware counts HTTP requests.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specdec_core.engine import Engine, StepReport

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
ACCEPTANCE_WINDOW = 100  # speculative steps per method behind acceptance_rate
CLIENT_CLOSED = 499  # nginx's status for a request whose client went away before its answer


class Metrics:
    """The server's metrics; `render()` gives the Prometheus text."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(f"specdec_{name}", doc, labels, registry=self.registry)

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(f"specdec_{name}", doc, labels, registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"specdec_{name}", doc, buckets=buckets, registry=self.registry)

        method, position = ("method",), ("method", "position")
        self.requests = counter("requests_total", "HTTP requests by endpoint and status code", ("endpoint", "status"))
        self.generated_tokens = counter("generated_tokens_total", "Tokens the engine emitted (before stop-string truncation)")
        self.draft_tokens = counter("draft_tokens_total", "Draft tokens proposed", method)
        self.accepted_tokens = counter("accepted_tokens_total", "Draft tokens the target accepted", method)
        self.draft_per_position = counter(
            "draft_tokens_per_position_total", "Draft tokens proposed at each draft position (1 = first)", position
        )
        self.accepted_per_position = counter(
            "accepted_tokens_per_position_total", "Draft tokens accepted at each draft position (1 = first)", position
        )
        self.verify_steps = counter("verify_steps_total", "Sequence verifications (per sequence with drafts, per step)", method)
        self.acceptance_rate = gauge(
            "acceptance_rate", f"Accepted / drafted over the last {ACCEPTANCE_WINDOW} speculative steps", method
        )
        self.gamma = histogram("gamma", "Draft length chosen per step (0 = plain decoding)", (0, 1, 2, 3, 4, 5, 6, 8, 12, 16, 32))
        self.batch_size = histogram("batch_size", "Sequences per decode step", (1, 2, 4, 8, 16, 32, 64, 128))
        self.decode_steps = counter("decode_steps_total", "Decode steps by mode (speculative or plain)", ("mode",))
        self.ttft = histogram(
            "time_to_first_token_seconds", "From request arrival to its first token",
            (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Between consecutive tokens of a sequence (0 for tokens accepted together)",
            (0, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
        )
        self.request_latency = histogram(
            "request_latency_seconds", "From request arrival to its last token",
            (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        )
        self.grammar_compile = histogram(
            "grammar_compile_seconds", "Compiling a response_format schema or a request's tools into a grammar (each once)",
            (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
        )
        self.grammar_mask = histogram(
            "grammar_mask_seconds", "Per step with constrained rows: their grammars' masks for every position of the pass",
            (0.00001, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1),
        )
        self.grammar_draft_tokens = counter("grammar_draft_tokens_total", "Tokens drafted by the grammar (forced continuations)")
        self.grammar_accepted_tokens = counter("grammar_accepted_tokens_total", "Grammar-drafted tokens the target accepted")
        self.queue_depth = gauge("queue_depth", "Requests waiting for a batch slot")
        self.running_requests = gauge("running_requests", "Requests with sequences in the batch")
        # By the budget spent only: a client label would be unbounded, and name keys.
        self.rate_limited = counter(
            "rate_limited_total", "Requests refused by a per-client budget (requests or tokens)", ("reason",)
        )
        self._windows: dict[str, deque[tuple[int, int]]] = defaultdict(lambda: deque(maxlen=ACCEPTANCE_WINDOW))

    def serving(self, method: str, gamma_max: int) -> None:
        """Start the method's series at zero, so that a rate over the first traffic is not lost to a missing first sample."""
        for mode in ("speculative", "plain"):
            self.decode_steps.labels(mode)
        if method == "none":
            return
        for counter in (self.draft_tokens, self.accepted_tokens, self.verify_steps):
            counter.labels(method)
        for position in range(1, gamma_max + 1):
            self.draft_per_position.labels(method, str(position))
            self.accepted_per_position.labels(method, str(position))

    def watch_prefill(self, engine: Engine) -> None:
        """Export the engine's prefill chunks and its prefix cache's figures, read as each scrape asks."""
        self.registry.register(_PrefillCollector(engine))

    def observe_step(self, report: StepReport) -> None:
        """Record one engine step: its mode, gamma, batch size, and what was drafted and accepted."""
        self.decode_steps.labels(report.mode).inc()
        self.gamma.observe(report.gamma)
        self.batch_size.observe(report.batch_size)
        self.generated_tokens.inc(sum(len(row.new_tokens) for row in report.rows))
        if report.grammar_s:
            self.grammar_mask.observe(report.grammar_s)
        self.grammar_draft_tokens.inc(sum(row.grammar_drafted for row in report.rows))
        self.grammar_accepted_tokens.inc(sum(row.grammar_accepted for row in report.rows))
        if report.mode != "speculative":
            return
        method = report.method
        drafted = sum(row.drafted for row in report.rows)
        accepted = sum(row.accepted for row in report.rows)
        self.draft_tokens.labels(method).inc(drafted)
        self.accepted_tokens.labels(method).inc(accepted)
        self.verify_steps.labels(method).inc(sum(1 for row in report.rows if row.drafted))
        for position, (d, a) in enumerate(zip(report.drafted_per_position, report.accepted_per_position), start=1):
            self.draft_per_position.labels(method, str(position)).inc(d)
            self.accepted_per_position.labels(method, str(position)).inc(a)
        window = self._windows[method]
        window.append((drafted, accepted))
        total = sum(d for d, _ in window)
        if total:
            self.acceptance_rate.labels(method).set(sum(a for _, a in window) / total)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PrefillCollector(Collector):
    """The engine's own running counts as Prometheus series: the worker thread only adds to plain integers."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("specdec_prefill_chunks", "Prefill passes run (a long prompt takes several chunks)",
                                  value=self.engine.chunks)
        cache = self.engine.prefix_cache
        if cache is None:
            return
        counts = cache.counts
        for name, doc, value in (
            ("prefix_cache_hit_tokens", "Prompt tokens the prefix cache gave", counts.hit_tokens),
            ("prefix_cache_miss_tokens", "Prompt tokens prefilled (not in the prefix cache)", counts.miss_tokens),
            ("prefix_cache_evicted_blocks", "Chunks the prefix cache evicted to stay within its budget", counts.evicted_blocks),
        ):
            yield CounterMetricFamily(f"specdec_{name}", doc, value=value)
        yield GaugeMetricFamily("specdec_prefix_cache_bytes", "Bytes the prefix cache holds", value=cache.bytes)
        yield GaugeMetricFamily("specdec_prefix_cache_budget_bytes", "The prefix cache's budget (prefill.cache_bytes)",
                                value=cache.budget_bytes)


class RequestCounter:
    """Counts requests_total{endpoint,status} from the status each response starts with; a request
    the app failed before it answered counts as 500 (the outermost handler answers it), and one it
    never answered (the client left first) as 499."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        # Unknown paths share one label so that scanners cannot blow up the label set.
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"

        started = False

        async def counting_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not started:
                self.metrics.requests.labels(endpoint, "500").inc()
            raise
        if not started:
            self.metrics.requests.labels(endpoint, str(CLIENT_CLOSED)).inc()
