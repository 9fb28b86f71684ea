"""Prometheus metrics of the service: requests, bytes in and out and latency per route (the route's
template, never a key or a name, so labels stay few and reveal nothing).

Several uvicorn workers each count their own: with `PROMETHEUS_MULTIPROC_DIR` set (`layerctl
serve` sets it to a fresh directory before the workers start), `/metrics` sums every worker's
files (prometheus-client's multiprocess mode)."""

from __future__ import annotations

import os
import time
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import REGISTRY as DEFAULT_REGISTRY

REQUESTS = Counter("layerstore_service_requests", "HTTP requests answered", ["route", "method", "status"])
BYTES_IN = Counter("layerstore_service_request_bytes", "Request body bytes received", ["route"])
BYTES_OUT = Counter("layerstore_service_response_bytes", "Response body bytes sent", ["route"])
LATENCY = Histogram("layerstore_service_request_seconds", "Time from request to the end of the answer",
                    ["route", "method"],
                    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))


def exposition() -> tuple[bytes, str]:
    """The text of `/metrics` and its content type."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(DEFAULT_REGISTRY), CONTENT_TYPE_LATEST


class MetricsMiddleware:
    """Pure ASGI middleware: counts each HTTP request under the template of the route that
    answered it (`unmatched` for none)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        counts = {"in": 0, "out": 0, "status": 500}

        async def counting_receive() -> Any:
            message = await receive()
            if message.get("type") == "http.request":
                counts["in"] += len(message.get("body", b""))
            return message

        async def counting_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                counts["status"] = message["status"]
            elif message["type"] == "http.response.body":
                counts["out"] += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, counting_receive, counting_send)
        finally:
            route = scope.get("route")
            name = getattr(route, "path", None) or "unmatched"
            method = scope.get("method", "")
            REQUESTS.labels(name, method, str(counts["status"])).inc()
            BYTES_IN.labels(name).inc(counts["in"])
            BYTES_OUT.labels(name).inc(counts["out"])
            LATENCY.labels(name, method).observe(time.perf_counter() - start)
