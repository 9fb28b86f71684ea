"""The daemon over every backend: local directory, CephFS (ceph-fuse) and S3 (Ceph RGW); and the
S3 store going down and coming back while the daemon serves."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
from testkit.erofs_helpers import assert_trees_equal, mounted_erofs, snapshot_tree
from testkit.fuse_helpers import DaemonProcess, build_and_push, make_tree, read_errno

from layerstore.store import Store

pytestmark = pytest.mark.root

# Fewer botocore retries: the daemon does its own retrying up to the fetch deadline.
S3_DAEMON_ENV = {"AWS_MAX_ATTEMPTS": "2"}


@pytest.fixture(params=["local", pytest.param("cephfs", marks=pytest.mark.ceph),
                        pytest.param("s3", marks=pytest.mark.ceph)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "store")
    return str(request.getfixturevalue(f"{request.param}_store_url"))


def test_erofs_over_backend(store_url: str, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", small=30, big=(2 << 20,), seed=5)
    with Store.open(store_url) as store:
        store.init()
        layer = build_and_push(store, src, tmp_path / "image.erofs")
    env = S3_DAEMON_ENV if store_url.startswith("s3://") else None
    with DaemonProcess(store_url, tmp_path / "cache", tmp_path / "mnt", env=env) as d:
        with mounted_erofs(d.blob(layer.blob)) as mnt:
            (mnt / "d3" / "small3.txt").read_bytes()
            lazy = d.stats()["blobs"][layer.blob]["fetched_bytes"]
            assert lazy < layer.size // 2
            assert_trees_equal(snapshot_tree(src, root_meta=False), snapshot_tree(mnt, root_meta=False))
        st = d.stats()
        assert st["blobs"][layer.blob]["fetched_bytes"] <= layer.size
        assert st["store_errors"] == 0 and st["corrupt_chunks"] == 0


@pytest.mark.ceph
def test_s3_store_down_and_back(ceph: Any, s3_store_url: str, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", small=20, big=(3 << 20,), seed=9)
    with Store.open(s3_store_url) as store:
        store.init()
        layer = build_and_push(store, src, tmp_path / "image.erofs")
    want = layer.path.read_bytes()
    data = [r for r in layer.refs if not r.metadata and r.length >= 8192]
    cached, missing = data[0], data[-1]
    with DaemonProcess(s3_store_url, tmp_path / "cache", tmp_path / "mnt", "--fetch-deadline", "1.5",
                       env=S3_DAEMON_ENV) as d:
        path = d.blob(layer.blob)
        fd = os.open(path, os.O_RDONLY)
        try:
            assert os.pread(fd, 8192, cached.offset) == want[cached.offset:cached.offset + 8192]
            ceph.stop_rgw()
            try:
                # Cached data keeps being served; missing data fails after the deadline.
                assert os.pread(fd, 8192, cached.offset) == want[cached.offset:cached.offset + 8192]
                assert read_errno(path, missing.offset, 4096) == errno.EIO
                assert d.proc is not None and d.proc.poll() is None
                assert d.stats()["store_errors"] > 0
            finally:
                ceph.start_rgw()
            assert os.pread(fd, 4096, missing.offset) == want[missing.offset:missing.offset + 4096]
        finally:
            os.close(fd)
