"""A layer mount that is busy when its last sandbox lets go is detached lazily, and then its pin
(direct mount) or attachment (fanotify) stays: a process still reading through the detached
mount must never meet a range the cache would punch once unpinned or detached (docs/fanotify.md,
window 7). A mount that is not busy lets go of both as before. A tmpfs stands in for the EROFS
layer (what matters is the unmount's outcome); the blob source records the calls."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from layerstore import linux
from runtime_shim.node.layers import DIRECT, LayerMounts
from runtime_shim.nodestate.paths import NodePaths
from runtime_shim.nodestate.state import ATTACHED_PREFIX, LayerMount

pytestmark = pytest.mark.root

BLOB = "b3:" + "cd" * 32


class RecordingBlobs:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []

    def unpin(self, blob: str, holder: str) -> None:
        self.calls.append(("unpin", blob, holder))

    def detach(self, blob: str, holder: str) -> None:
        self.calls.append(("detach", blob, holder))


def _mounted(tmp_path: Path, name: str) -> Path:
    mp = tmp_path / name
    mp.mkdir()
    linux.mount("tmpfs", mp, "tmpfs")
    (mp / "f").write_bytes(b"layer bytes")
    return mp


@pytest.mark.parametrize("kind", ["direct", "attached"])
@pytest.mark.parametrize("busy", [False, True])
def test_a_busy_layer_mount_keeps_its_pin_or_attachment(tmp_path, kind, busy):
    blobs = RecordingBlobs()
    layers = LayerMounts(NodePaths(tmp_path / "node"), blobs)  # type: ignore[arg-type]
    mp = _mounted(tmp_path, "layer")
    lm = (LayerMount(BLOB, str(mp), "/cache/data", 0, DIRECT, pin="shim:x") if kind == "direct"
          else LayerMount(BLOB, str(mp), "/cache/data", 0, ATTACHED_PREFIX + "g|daemon:1:2"))
    fd = os.open(mp / "f", os.O_RDONLY) if busy else None
    try:
        layers.unmount(lm)
        assert not mp.exists() or not linux.is_mount(mp)
        if busy:
            assert blobs.calls == []
            assert os.pread(fd, 5, 0) == b"layer"  # (still readable through the detached mount)
        else:
            assert [c[0] for c in blobs.calls] == (["unpin"] if kind == "direct" else ["detach"])
    finally:
        if fd is not None:
            os.close(fd)
        if mp.exists() and linux.is_mount(mp):
            linux.umount(mp, lazy=True)
