"""Prometheus metrics of one app, in its own registry (so several apps can live in a process)."""

from __future__ import annotations

from typing import Any

from .._extras import require

__all__ = ["Metrics"]

# request latency from sub-millisecond (health) to seconds (long batches under load)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536)


class Metrics:
    """Counters and histograms exported at ``GET /metrics`` in Prometheus text format.

    - ``multihead_requests_total{endpoint, status}``: every response.
    - ``multihead_request_errors_total{endpoint, status}``: responses with status >= 400.
    - ``multihead_request_duration_seconds{endpoint}``: latency histogram.
    - ``multihead_batch_size`` / ``multihead_batch_tokens``: texts and tokens per model batch.
    - ``multihead_tokens_total``: tokens embedded; ``multihead_in_flight``: requests admitted.
    """

    def __init__(self) -> None:
        prometheus = require("prometheus_client", "serve", "multihead serve")
        self._prometheus = prometheus
        self.registry = prometheus.CollectorRegistry()
        kw: dict[str, Any] = {"registry": self.registry}
        self.requests = prometheus.Counter(
            "multihead_requests", "HTTP responses", ["endpoint", "status"], **kw
        )
        self.errors = prometheus.Counter(
            "multihead_request_errors", "HTTP responses with status >= 400",
            ["endpoint", "status"], **kw,
        )  # fmt: skip
        self.latency = prometheus.Histogram(
            "multihead_request_duration_seconds", "time from request to response",
            ["endpoint"], buckets=_LATENCY_BUCKETS, **kw,
        )  # fmt: skip
        self.batch_size = prometheus.Histogram(
            "multihead_batch_size", "texts per model batch", buckets=_BATCH_BUCKETS, **kw
        )
        self.batch_tokens = prometheus.Histogram(
            "multihead_batch_tokens", "tokens per model batch", buckets=_TOKEN_BUCKETS, **kw
        )
        self.tokens = prometheus.Counter("multihead_tokens", "tokens embedded", **kw)
        self.in_flight = prometheus.Gauge(
            "multihead_in_flight", "requests admitted and not yet answered", **kw
        )

    def observe(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        if status >= 400:
            self.errors.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)

    def batch(self, texts: int, tokens: int) -> None:
        self.batch_size.observe(texts)
        self.batch_tokens.observe(tokens)
        self.tokens.inc(tokens)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return self._prometheus.generate_latest(self.registry), self._prometheus.CONTENT_TYPE_LATEST
