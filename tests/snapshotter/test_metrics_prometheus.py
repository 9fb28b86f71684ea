"""The snapshotter counts each gRPC call by method and gRPC status (errors apart) and reports the
lazy layers it holds, in its own registry (docs/metrics.md); the end-to-end scrape by a real
Prometheus is tests/fuse_client/test_metrics_prometheus.py."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from snapshotter import server
from snapshotter.layers import RemoteLayers
from snapshotter.metrics import SnapshotterMetrics
from snapshotter.snapshots import Snapshotter
from snapshotter.stubs import snapshots_pb2 as pb
from snapshotter.stubs import snapshots_pb2_grpc as pbg
from tests.snapshotter.conftest import DirBlobs, code_of, detach_under


def test_calls_are_counted_by_method_and_status(tmp_path: Path) -> None:
    (tmp_path / "blobs").mkdir()
    root = tmp_path / "snap"
    sn = Snapshotter(root, RemoteLayers.with_blobs(root, tmp_path / "node", DirBlobs(tmp_path / "blobs")))
    metrics = SnapshotterMetrics(layers_held=lambda: server.layers_held(sn))
    srv = server.start(sn, tmp_path / "snap.sock", workers=2, metrics=metrics)
    try:
        with grpc.insecure_channel(f"unix://{tmp_path / 'snap.sock'}") as ch:
            stub = pbg.SnapshotsStub(ch)
            stub.Prepare(pb.PrepareSnapshotRequest(key="a"), timeout=30)
            assert code_of(stub.Prepare, pb.PrepareSnapshotRequest(key="a"), timeout=30) == \
                grpc.StatusCode.ALREADY_EXISTS
            assert code_of(stub.Stat, pb.StatSnapshotRequest(key="nope"), timeout=30) == grpc.StatusCode.NOT_FOUND
            stub.Remove(pb.RemoveSnapshotRequest(key="a"), timeout=30)
        reg = metrics.registry  # (read before the snapshotter closes: the gauge asks its state)

        def calls(method: str, status: str) -> float | None:
            return reg.get_sample_value("layerstore_snapshotter_calls_total", {"method": method, "status": status})

        assert calls("Prepare", "OK") == 1 and calls("Prepare", "ALREADY_EXISTS") == 1
        assert calls("Stat", "NOT_FOUND") == 1 and calls("Remove", "OK") == 1 and calls("Remove", "NOT_FOUND") is None
        assert reg.get_sample_value("layerstore_snapshotter_call_seconds_count", {"method": "Prepare"}) == 2
        assert reg.get_sample_value("layerstore_snapshotter_errors_total", {"method": "Prepare"}) is None
        assert reg.get_sample_value("layerstore_snapshotter_lazy_layers_mounted") == 0
    finally:
        srv.stop(grace=None).wait()
        sn.close()
        detach_under(tmp_path)


def test_unexpected_failures_are_errors() -> None:
    m = SnapshotterMetrics()
    m.observe("Usage", "UNKNOWN", 0.5)
    m.observe("Usage", "NOT_FOUND", 0.1)
    assert m.registry.get_sample_value("layerstore_snapshotter_errors_total", {"method": "Usage"}) == 1
    assert b'layerstore_snapshotter_calls_total{method="Usage",status="UNKNOWN"} 1.0' in m.prometheus()
    assert b"lazy_layers_mounted" not in m.prometheus()  # (no gauge without a way to count)


@pytest.mark.parametrize("held", [0, 3])
def test_the_gauge_is_read_at_scrape_time(held: int) -> None:
    box = {"n": -1}
    m = SnapshotterMetrics(layers_held=lambda: box["n"])
    box["n"] = held
    assert m.registry.get_sample_value("layerstore_snapshotter_lazy_layers_mounted") == held
