"""The snapshotter's Prometheus figures: each gRPC call by method and the status it answered,
its latency, and the lazy layers it holds mounted now. Its own registry (not the process-wide
default), so a test or a second snapshotter in one process counts apart.

Written from the gRPC worker threads (prometheus-client's counters lock); read by the metrics
listener's thread (layerstore.metrics_listen) at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

CALL_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class SnapshotterMetrics:
    def __init__(self, layers_held: Callable[[], int] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.calls = Counter("layerstore_snapshotter_calls", "gRPC calls answered, by method and status code",
                             ["method", "status"], registry=self.registry)
        self.errors = Counter("layerstore_snapshotter_errors", "gRPC calls that failed with an unexpected "
                              "error (status UNKNOWN)", ["method"], registry=self.registry)
        self.seconds = Histogram("layerstore_snapshotter_call_seconds", "Time to answer a gRPC call",
                                 ["method"], buckets=CALL_BUCKETS, registry=self.registry)
        if layers_held is not None:
            self.registry.register(_Held(layers_held))

    def observe(self, method: str, status: str, seconds: float) -> None:
        self.calls.labels(method, status).inc()
        if status == "UNKNOWN":
            self.errors.labels(method).inc()
        self.seconds.labels(method).observe(seconds)

    def prometheus(self) -> bytes:
        return generate_latest(self.registry)


class _Held:
    def __init__(self, count: Callable[[], int]) -> None:
        self.count = count

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("layerstore_snapshotter_lazy_layers_mounted", "")

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("layerstore_snapshotter_lazy_layers_mounted",
                                "Layerstore layers mounted lazily and held by this snapshotter now",
                                value=self.count())
