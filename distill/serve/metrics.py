"""The service's Prometheus metrics (``GET /metrics``, text exposition format), in a registry of its own."""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# batch sizes are counted in images; stage and request times in seconds
_SIZES = (1, 2, 4, 8, 16, 32, 64)
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServeMetrics:
    """Queue depth, requests in flight, batch sizes and time per stage, request latency and outcome, images
    made and images/s over the last ``window_s`` seconds."""

    def __init__(self, window_s: float = 30.0):
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge("distill_serve_queue_depth", "Requests waiting to enter the first stage", registry=r)
        self.inflight = Gauge("distill_serve_requests_in_flight", "Requests accepted and not yet answered", registry=r)
        self.batch_size = Histogram("distill_serve_batch_size_images", "Images per batch of each stage", ["stage"],
                                    buckets=_SIZES, registry=r)
        self.stage_seconds = Histogram("distill_serve_stage_seconds", "Seconds per batch of each stage", ["stage"],
                                       buckets=_SECONDS, registry=r)
        self.request_seconds = Histogram("distill_serve_request_seconds", "Seconds from arrival to answer of "
                                         "requests that got images", buckets=_SECONDS, registry=r)
        self.requests = Counter("distill_serve_requests", "Requests answered, by HTTP status", ["code"], registry=r)
        self.images = Counter("distill_serve_images", "Images generated", registry=r)
        self.dropped = Counter("distill_serve_dropped", "Requests dropped past their deadline or cancelled",
                               registry=r)
        self.throughput = Gauge("distill_serve_images_per_second", "Images per second over the last window",
                                registry=r)
        self.throughput.set_function(self.images_per_second)
        self.window_s = window_s
        self._recent: deque[tuple[float, int]] = deque()
        self._start = time.monotonic()
        self._lock = threading.Lock()

    def completed(self, images: int, latency_s: float) -> None:
        now = time.monotonic()
        self.images.inc(images)
        with self._lock:
            self._recent.append((now, images))

    def images_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - self.window_s:
                self._recent.popleft()
            span = min(self.window_s, now - self._start)  # the window, or the uptime when shorter
            return sum(n for _, n in self._recent) / span if span > 0 else 0.0

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
