"""The node daemon reading through the store service, and the service killed under it: cached
reads keep working, uncached ones follow the store-outage rules (retried until the fetch
deadline, then EIO; the daemon stays up), and reads resume once the service is back."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from testkit.fuse_helpers import DaemonProcess, build_and_push, make_tree, read_errno
from testkit.store_service import free_port, make_tokens, start_service

from layerstore.store import Store

pytestmark = pytest.mark.root


def _pread(path: Path, offset: int, length: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


def test_service_killed_while_the_daemon_reads(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    with Store.open(str(store_dir)) as s:
        s.init()
        layer = build_and_push(s, make_tree(tmp_path / "src", small=10, big=(6 << 20,)), tmp_path / "layer.img")
    want = layer.path.read_bytes()
    tokens = make_tokens(tmp_path / "tokens.json", {"node": ["read", "lease"]})
    port = free_port()
    svc = start_service(str(store_dir), tmp_path / "svc", tokens=tmp_path / "tokens.json", port=port)
    try:
        with DaemonProcess(svc.url, tmp_path / "cache", tmp_path / "mnt", "--fetch-deadline", "2",
                           "--readahead", "0", env={"LAYERSTORE_TOKEN": tokens["node"]}) as d:
            blob = d.blob(layer.blob)
            half = len(want) // 2
            # the first half through the service, into the node cache
            assert _pread(blob, 0, half) == want[:half]
            # a chunk of the second half that nothing has read yet
            ref = next(r for r in layer.refs if r.offset >= half + (1 << 20) and r.length >= 8192)

            svc.kill()
            assert _pread(blob, 0, half) == want[:half]  # cached: unaffected
            assert read_errno(blob, ref.offset, 4096) == errno.EIO  # uncached: EIO after the deadline
            assert d.proc is not None and d.proc.poll() is None  # the daemon stays up
            assert d.stats()["store_errors"] > 0

            svc = start_service(str(store_dir), tmp_path / "svc", tokens=tmp_path / "tokens.json", port=port)
            assert _pread(blob, ref.offset, 4096) == want[ref.offset:ref.offset + 4096]
            assert blob.read_bytes() == want
    finally:
        svc.stop()
