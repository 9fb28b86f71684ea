"""Fixtures of the snapshotter tests: the snapshots service served in this process on a unix
socket (layers from a directory of EROFS images), and a gRPC client of it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from layerstore import linux
from runtime_shim.node.blobs import DirBlobs
from snapshotter import server
from snapshotter.layers import RemoteLayers
from snapshotter.snapshots import Snapshotter
from snapshotter.stubs import snapshots_pb2 as pb
from snapshotter.stubs import snapshots_pb2_grpc as pbg


@dataclass
class Served:
    sn: Snapshotter
    stub: pbg.SnapshotsStub
    root: Path
    blobs: Path

    def prepare(self, key: str, parent: str = "", labels: dict[str, str] | None = None) -> list:
        return list(self.stub.Prepare(pb.PrepareSnapshotRequest(key=key, parent=parent, labels=labels or {})).mounts)

    def view(self, key: str, parent: str = "") -> list:
        return list(self.stub.View(pb.ViewSnapshotRequest(key=key, parent=parent)).mounts)

    def mounts(self, key: str) -> list:
        return list(self.stub.Mounts(pb.MountsRequest(key=key)).mounts)

    def commit(self, name: str, key: str, labels: dict[str, str] | None = None) -> None:
        self.stub.Commit(pb.CommitSnapshotRequest(name=name, key=key, labels=labels or {}))

    def remove(self, key: str) -> None:
        self.stub.Remove(pb.RemoveSnapshotRequest(key=key))

    def stat(self, key: str) -> pb.Info:
        return self.stub.Stat(pb.StatSnapshotRequest(key=key)).info

    def walk(self, *filters: str) -> dict[str, pb.Info]:
        return {i.name: i for res in self.stub.List(pb.ListSnapshotsRequest(filters=list(filters))) for i in res.info}

    def usage(self, key: str) -> tuple[int, int]:
        u = self.stub.Usage(pb.UsageRequest(key=key))
        return u.size, u.inodes


def code_of(fn, *args, **kw) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    """The status code a call fails with (fails the test if it succeeds)."""
    with pytest.raises(grpc.RpcError) as ei:
        fn(*args, **kw)
    return ei.value.code()  # type: ignore[no-any-return]


def detach_under(root: Path) -> None:
    for m in sorted(linux.mounts_under(linux.read_mounts(), str(root)), key=lambda m: m.mountpoint.count("/"),
                    reverse=True):
        with contextlib.suppress(linux.MountError):
            linux.umount(m.mountpoint, lazy=True)


@contextlib.contextmanager
def served(root: Path, blobs: Path, sock: Path) -> Iterator[Served]:
    blobs.mkdir(parents=True, exist_ok=True)
    sn = Snapshotter(root, RemoteLayers.with_blobs(root, root.parent / "node", DirBlobs(blobs)))
    srv = server.start(sn, sock, workers=4)
    channel = grpc.insecure_channel(f"unix://{sock}")
    try:
        yield Served(sn, pbg.SnapshotsStub(channel), root, blobs)
    finally:
        channel.close()
        srv.stop(grace=None).wait()
        sn.close()


@pytest.fixture
def snaps(tmp_path: Path) -> Iterator[Served]:
    try:
        with served(tmp_path / "snap", tmp_path / "blobs", tmp_path / "snap.sock") as s:
            yield s
    finally:
        detach_under(tmp_path)
