"""REST-side Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics import MetricWrapperBase


class RestMetrics:
    """REST-side Prometheus metrics, in a registry of their own so apps do not collide."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "glmimage_rest_requests",
            "HTTP requests answered, by route and status code.",
            ["route", "status"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "glmimage_rest_request_duration_seconds",
            "HTTP request duration, by route.",
            ["route"],
            buckets=(0.005, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=self.registry,
        )
        self.images = Counter(
            "glmimage_rest_images", "Images returned to HTTP clients.", registry=self.registry
        )
        # The labelled children by their labels: prometheus_client's labels() validates and locks on every call.
        self._children: dict[tuple[str, ...], MetricWrapperBase] = {}

    def answered(self, route: str, status: int, seconds: float) -> None:
        """One HTTP request answered: counted by route and status, its duration by route."""
        key = (route, str(status))
        if (count := self._children.get(key)) is None:
            count = self._children[key] = self.requests.labels(route=route, status=key[1])
        if (duration := self._children.get((route,))) is None:
            duration = self._children[(route,)] = self.duration.labels(route=route)
        count.inc()  # type: ignore[attr-defined]
        duration.observe(seconds)  # type: ignore[attr-defined]
