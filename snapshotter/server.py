"""The gRPC edge: containerd's snapshots service over a unix socket, each call handed to the
`Snapshotter`, each expected error translated to the status code containerd's errdefs maps back
(NotFound, AlreadyExists, FailedPrecondition, InvalidArgument; anything else Unknown)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf import empty_pb2, timestamp_pb2

from layerstore.errors import BadInput, ConfigError, LayerstoreError, NotFound, PermissionDenied
from layerstore.metrics_listen import SNAPSHOTTER_ENV, MetricsListener, wanted

from .errors import SnapshotExists, SnapshotPrecondition
from .metadata import ACTIVE, COMMITTED, VIEW, Snapshot
from .metrics import SnapshotterMetrics
from .snapshots import Mount, Snapshotter
from .stubs import snapshots_pb2 as pb
from .stubs import snapshots_pb2_grpc as pbg
from .stubs import types_pb2

log = logging.getLogger("layerstore.snapshotter")
T = TypeVar("T")
KIND = {VIEW: pb.VIEW, ACTIVE: pb.ACTIVE, COMMITTED: pb.COMMITTED}
LIST_BATCH = 100


def status_of(e: LayerstoreError) -> grpc.StatusCode:
    if isinstance(e, SnapshotExists):
        return grpc.StatusCode.ALREADY_EXISTS
    if isinstance(e, SnapshotPrecondition):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(e, NotFound):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(e, PermissionDenied):
        return grpc.StatusCode.PERMISSION_DENIED
    if isinstance(e, ConfigError | BadInput):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.UNKNOWN


def _ts(t: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(t * 1e9))
    return ts


def info_of(snap: Snapshot) -> pb.Info:
    return pb.Info(name=snap.key, parent=snap.parent, kind=KIND[snap.kind], created_at=_ts(snap.created),
                   updated_at=_ts(snap.updated), labels=snap.labels)


def mounts_of(mounts: list[Mount]) -> list[types_pb2.Mount]:
    return [types_pb2.Mount(type=m.type, source=m.source, options=list(m.options)) for m in mounts]


class SnapshotsService(pbg.SnapshotsServicer):
    def __init__(self, sn: Snapshotter, metrics: SnapshotterMetrics | None = None) -> None:
        self.sn = sn
        self.metrics = metrics or SnapshotterMetrics()

    def _call(self, context: grpc.ServicerContext, fn: Callable[[], T], method: str) -> T:
        start, code = time.perf_counter(), grpc.StatusCode.UNKNOWN
        try:
            result = fn()
            code = grpc.StatusCode.OK
            return result
        except LayerstoreError as e:
            code = status_of(e)
            if code != grpc.StatusCode.ALREADY_EXISTS:
                log.info("%s: %s", code.name, e)
            context.abort(code, str(e))
        except OSError as e:
            log.exception("snapshotter call failed")
            context.abort(grpc.StatusCode.UNKNOWN, f"{type(e).__name__}: {e}")
        finally:
            self.metrics.observe(method, code.name, time.perf_counter() - start)
        raise AssertionError("unreachable")

    def Prepare(self, request: Any, context: grpc.ServicerContext) -> Any:
        m = self._call(context, lambda: self.sn.prepare(request.key, request.parent, dict(request.labels)), "Prepare")
        return pb.PrepareSnapshotResponse(mounts=mounts_of(m))

    def View(self, request: Any, context: grpc.ServicerContext) -> Any:
        m = self._call(context, lambda: self.sn.view(request.key, request.parent, dict(request.labels)), "View")
        return pb.ViewSnapshotResponse(mounts=mounts_of(m))

    def Mounts(self, request: Any, context: grpc.ServicerContext) -> Any:
        m = self._call(context, lambda: self.sn.mounts(request.key), "Mounts")
        return pb.MountsResponse(mounts=mounts_of(m))

    def Commit(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._call(context, lambda: self.sn.commit(request.name, request.key, dict(request.labels)), "Commit")
        return empty_pb2.Empty()

    def Remove(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._call(context, lambda: self.sn.remove(request.key), "Remove")
        return empty_pb2.Empty()

    def Stat(self, request: Any, context: grpc.ServicerContext) -> Any:
        snap = self._call(context, lambda: self.sn.stat(request.key), "Stat")
        return pb.StatSnapshotResponse(info=info_of(snap))

    def Update(self, request: Any, context: grpc.ServicerContext) -> Any:
        info = request.info
        paths = list(request.update_mask.paths)
        snap = self._call(context, lambda: self.sn.update(info.name, dict(info.labels), paths), "Update")
        return pb.UpdateSnapshotResponse(info=info_of(snap))

    def List(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        snaps = self._call(context, lambda: self.sn.walk(list(request.filters)), "List")
        for i in range(0, len(snaps), LIST_BATCH):
            yield pb.ListSnapshotsResponse(info=[info_of(s) for s in snaps[i:i + LIST_BATCH]])

    def Usage(self, request: Any, context: grpc.ServicerContext) -> Any:
        size, inodes = self._call(context, lambda: self.sn.usage(request.key), "Usage")
        return pb.UsageResponse(size=size, inodes=inodes)

    def Cleanup(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._call(context, self.sn.cleanup, "Cleanup")
        return empty_pb2.Empty()


def layers_held(sn: Snapshotter) -> int:
    """Lazy layers this snapshotter holds mounted now (a scrape-time gauge)."""
    return len(sn.layers.held()) if sn.layers is not None else 0


def start(sn: Snapshotter, address: str | os.PathLike[str], workers: int = 32,
          metrics: SnapshotterMetrics | None = None) -> grpc.Server:
    """Serve on a unix socket (0600). The socket is bound under a temporary name and renamed over
    `address` once the server listens: a client never finds a socket that refuses connections, and
    a stale one is replaced in one step. `workers`: calls served at once (a Prepare waiting for a
    cold layer's metadata holds one: room for a burst's pulls and containers together)."""
    path = Path(os.path.abspath(address))
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="snapshotter"))
    pbg.add_SnapshotsServicer_to_server(SnapshotsService(sn, metrics), server)
    old = os.umask(0o177)
    try:
        server.add_insecure_port(f"unix://{tmp}")
        server.start()
    finally:
        os.umask(old)
    os.rename(tmp, path)
    return server


def serve(sn: Snapshotter, address: str | os.PathLike[str], metrics_listen: str | None = None) -> None:
    """Serve until SIGTERM or SIGINT; then stop taking calls, finish those in flight, close.
    `metrics_listen` (else $LAYERSTORE_SNAPSHOTTER_METRICS_LISTEN): HOST:PORT of a Prometheus
    `/metrics` (docs/metrics.md); bound before the gRPC socket, so a taken port fails the start."""
    metrics = SnapshotterMetrics(layers_held=lambda: layers_held(sn))
    at = wanted(metrics_listen, SNAPSHOTTER_ENV)
    with MetricsListener(at, metrics.prometheus) if at else contextlib.nullcontext():
        _serve(sn, address, metrics)  # (a scrape after `sn.close()` and before the listener closes: one 500)


def _serve(sn: Snapshotter, address: str | os.PathLike[str], metrics: SnapshotterMetrics) -> None:
    server = start(sn, address, metrics=metrics)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    log.info("serving containerd's snapshots service at %s (root %s)", address, sn.root)
    try:
        while not done.wait(1.0):
            pass
    finally:
        server.stop(grace=5).wait()
        sn.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(address)
