"""What the server counts, and the one line it logs per request.

`/metrics` is Prometheus's text format (prometheus_client, its own registry per app): requests
by route and status, prompt / completion / cached tokens, time to first token and decode speed
as histograms, the sequences each decode step ran for, requests waiting for the worker,
requests whose client left before the end, and sequences preempted for want of KV blocks.
The access log is one line per request on stderr (method, route, status, tokens, ms), a
request whose client left included (status 499, as nginx logs it); `serve --quiet` turns it off.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Every route is its own label; any other path (a 404, a model's own URL) is "other", so that a
# client cannot grow the label set without bound.
ROUTES = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"}
    | {"/v1/responses", "/v1/messages", "/v1/messages/count_tokens"}
    | {"/api/chat", "/api/generate", "/api/show", "/api/tags", "/api/ps", "/api/version"}
)


class Metrics:
    def __init__(self) -> None:
        registry = self.registry = CollectorRegistry()
        self.requests = Counter(
            "llmcli_requests",
            "Requests answered, by route and status.",
            ["route", "status"],
            registry=registry,
        )
        self.tokens = Counter(
            "llmcli_tokens", "Tokens, by kind: prompt, completion, cached.", ["kind"], registry=registry
        )
        self.ttft = Histogram(
            "llmcli_time_to_first_token_seconds",
            "Seconds from a generation's start to its first token.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=registry,
        )
        self.decode = Histogram(
            "llmcli_decode_tokens_per_second",
            "Decode speed of each generation.",
            buckets=(1, 5, 10, 25, 50, 100, 200, 400, 800, 1600),
            registry=registry,
        )
        self.waiting = Gauge("llmcli_queue_depth", "Generations waiting for the worker.", registry=registry)
        self.step_sequences = Histogram(
            "llmcli_decode_step_sequences",
            "Sequences each decode step ran for (continuous batching).",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32),
            registry=registry,
        )
        self.preempted = Counter(
            "llmcli_preemptions",
            "Sequences set aside until a paged KV pool had room for them again (--kv-layout paged).",
            registry=registry,
        )
        self.cancelled = Counter(
            "llmcli_requests_cancelled",
            "Generations stopped or skipped because their client left.",
            registry=registry,
        )

    def generation(self, stats: Any) -> None:
        """A finished generation's figures (its GenerationStats)."""
        self.tokens.labels("prompt").inc(stats.prompt_tokens)
        self.tokens.labels("completion").inc(stats.completion_tokens)
        self.tokens.labels("cached").inc(stats.cached_tokens)
        if stats.completion_tokens:
            self.ttft.observe(stats.ttft_s)
        if stats.decode_tok_s:
            self.decode.observe(stats.decode_tok_s)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class Observed:
    """Counts every answer by route and status, and logs it in one line unless quiet. A route
    sets `scope["state"]["usage"]` = (prompt, completion) tokens for the line."""

    def __init__(self, app: ASGIApp, metrics: Metrics, quiet: bool) -> None:
        self.app, self.metrics, self.quiet = app, metrics, quiet

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status, answered, left = 500, False, False

        async def observing_receive() -> Message:
            nonlocal left
            message = await receive()
            left = left or message["type"] == "http.disconnect"
            return message

        async def observing_send(message: Message) -> None:
            nonlocal status, answered
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                answered = True
                self._done(scope, status, start)

        try:
            await self.app(scope, observing_receive, observing_send)
        finally:
            if not answered:  # a stream its client left is cancelled unfinished: 499, as nginx logs it
                self._done(scope, 499 if left else status, start)

    def _done(self, scope: Scope, status: int, start: float) -> None:
        path = scope.get("path", "")
        route = path if path in ROUTES else "other"
        self.metrics.requests.labels(route, str(status)).inc()
        if self.quiet:
            return
        usage = (scope.get("state") or {}).get("usage")
        tokens = f" · {usage[0]}+{usage[1]} tokens" if usage else ""
        milliseconds = (time.perf_counter() - start) * 1000
        sys.stderr.write(
            f"llmcli: {scope.get('method', '?')} {path} {status}{tokens} · {milliseconds:.0f} ms\n"
        )
        sys.stderr.flush()
