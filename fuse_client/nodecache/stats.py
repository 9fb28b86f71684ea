"""What lazy loading fetched and served: per-blob counters, error counters and fetch latency
histograms, as JSON (`layerctl stats`) and in Prometheus text format (the control socket).

The read path only adds to plain integers on a per-blob object (no locks, no label lookups); the
Prometheus families are built from those integers at scrape time by a custom collector.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# A cache gauge whose name is one of the counters above: renamed. Two families of one name are an
# invalid exposition (`promtool check metrics`: "second HELP line"; Prometheus 2.42 takes the
# scrape, but one name would mean two figures).
GAUGE_RENAMES = {"cache_write_failures": "cache_data_write_failures"}
FETCH_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class BlobStats:
    __slots__ = ("size", "fetched_bytes", "served_bytes", "hits", "misses", "fetches")

    def __init__(self, size: int) -> None:
        self.size = size
        self.fetched_bytes = 0  # uncompressed chunk bytes fetched from the store
        self.served_bytes = 0  # bytes returned to read() calls
        self.hits = 0  # read() calls served from the cache alone
        self.misses = 0  # read() calls that waited for at least one fetch
        self.fetches = 0  # chunk fetches from the store

    def to_json(self) -> dict[str, int]:
        return {"size": self.size, "fetched_bytes": self.fetched_bytes, "served_bytes": self.served_bytes,
                "hits": self.hits, "misses": self.misses}


class Stats:
    def __init__(self, gauges: Callable[[], dict[str, float]] | None = None) -> None:
        self.blobs: dict[str, BlobStats] = {}
        self.corrupt_chunks = 0
        self.store_errors = 0
        self.cache_write_failures = 0  # chunks fetched but not written to the node cache (EIO to the readers)
        self.metadata_pushes = 0  # metadata chunks pushed into the kernel's page cache
        self.metadata_pushed_bytes = 0
        self._gauges = gauges
        self.registry = CollectorRegistry(auto_describe=False)
        self.fetch_seconds = Histogram(
            "layerstore_fuse_fetch_seconds", "Time to fetch, verify and decompress one chunk from the store",
            ["priority"], buckets=FETCH_BUCKETS, registry=self.registry)
        self.registry.register(_Collector(self))

    def blob(self, blob: str, size: int) -> BlobStats:
        st = self.blobs.get(blob)
        if st is None:
            st = self.blobs[blob] = BlobStats(size)
        return st

    def count_metadata_push(self, nbytes: int) -> None:
        """A front end handed `nbytes` of metadata to the kernel's page cache at once."""
        self.metadata_pushes += 1
        self.metadata_pushed_bytes += nbytes

    def to_json(self) -> dict[str, object]:
        return {"blobs": {b: s.to_json() for b, s in sorted(self.blobs.items())},
                "corrupt_chunks": self.corrupt_chunks, "store_errors": self.store_errors,
                "cache_write_failures": self.cache_write_failures}

    def prometheus(self) -> bytes:
        return generate_latest(self.registry)

    def gauges(self) -> dict[str, float]:
        return self._gauges() if self._gauges else {}


class _Collector:
    def __init__(self, stats: Stats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        st = self.stats
        per_blob = {
            "fetched_bytes": "Uncompressed chunk bytes fetched from the store",
            "served_bytes": "Bytes returned to readers",
            "hits": "Read requests served from the node cache alone",
            "misses": "Read requests that waited for a fetch",
            "fetches": "Chunks fetched from the store",
        }
        blobs = list(st.blobs.items())
        for field, doc in per_blob.items():
            fam = CounterMetricFamily(f"layerstore_fuse_{field}", doc, labels=["blob"])
            for blob, bs in blobs:
                fam.add_metric([blob], getattr(bs, field))
            yield fam
        yield CounterMetricFamily("layerstore_fuse_corrupt_chunks", "Chunks that failed verification",
                                  value=st.corrupt_chunks)
        yield CounterMetricFamily("layerstore_fuse_store_errors", "Failed store requests", value=st.store_errors)
        yield CounterMetricFamily("layerstore_fuse_cache_write_failures", "Fetched chunks the node cache could not "
                                  "write (disk full or failing)", value=st.cache_write_failures)
        yield CounterMetricFamily("layerstore_fuse_metadata_pushes", "Pushes of metadata (runs of chunks) into the "
                                  "kernel's page cache (FUSE notify_store)", value=st.metadata_pushes)
        yield CounterMetricFamily("layerstore_fuse_metadata_pushed_bytes", "Bytes of metadata pushed into the "
                                  "kernel's page cache", value=st.metadata_pushed_bytes)
        for name, value in st.gauges().items():
            name = GAUGE_RENAMES.get(name, name)
            yield GaugeMetricFamily(f"layerstore_fuse_{name}", name.replace("_", " "), value=value)
