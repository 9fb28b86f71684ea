"""The snapshotter's layer mounts are the node's: a layer that a shim sandbox and a containerd
container both stack is one EROFS mount on the node (one line in /proc/self/mountinfo), counted
once for the sandbox and once for the snapshotter, and it stays until both have let go, in
either order."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from testkit.shim_support import busybox_image, needs_busybox

from layerstore import linux
from runtime_shim.node.blobs import DirBlobs
from runtime_shim.node.request import MountRequest
from runtime_shim.node.shim import Shim
from runtime_shim.nodestate.paths import NodePaths
from runtime_shim.resolve.environment import EnvSpec, LayerSpec
from snapshotter.snapshots import LABEL_BLOB, LABEL_REF, REMOTE_PREFIX

from .conftest import Served, code_of

pytestmark = [pytest.mark.root, needs_busybox]


def erofs_mounts_of(image: Path) -> list[str]:
    """Mount points of every EROFS mount of this image file (mountinfo: one line per mount)."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            rest = fields[fields.index("-") + 1:]
            if rest[0] == "erofs" and rest[1] == str(image):
                out.append(fields[4])
    return out


def refs(shim: Shim, blob: str) -> int:
    return shim.layer_refs().get(blob, 0)


def test_one_mount_shared_by_a_sandbox_and_a_container(snaps: Served, tmp_path: Path) -> None:
    _blobs, blob = busybox_image(tmp_path / "img")
    image = snaps.blobs / blob
    os.rename(tmp_path / "img" / "blobs" / blob, image)
    shim = Shim(NodePaths(snaps.root.parent / "node"), DirBlobs(snaps.blobs), backends={})
    spec = EnvSpec("", (LayerSpec(blob, 0, "base"),))
    labels = {LABEL_REF: "sha256:chain1", LABEL_BLOB: blob}
    layer = str(shim.paths.layer_mount(blob))
    try:
        for sandbox_first_out in (True, False):
            sb = shim.mount(MountRequest(spec, tmp_path / "sb-root"))
            assert erofs_mounts_of(image) == [layer] and refs(shim, blob) == 1
            assert code_of(snaps.prepare, "ns/1/extract sha256:chain1", "", labels).name == "ALREADY_EXISTS"
            [m] = snaps.prepare("ctr", REMOTE_PREFIX + "sha256:chain1")
            lowers = dict(o.split("=", 1) for o in m.options if "=" in o)["lowerdir"]
            assert lowers == layer  # the container stacks the node's mount of the layer
            assert erofs_mounts_of(image) == [layer] and refs(shim, blob) == 2  # once on the node, two users
            if sandbox_first_out:
                shim.unmount(sb.id)
                assert erofs_mounts_of(image) == [layer] and refs(shim, blob) == 1  # the container's still
                snaps.remove("ctr")
                snaps.remove(REMOTE_PREFIX + "sha256:chain1")
            else:
                snaps.remove("ctr")
                snaps.remove(REMOTE_PREFIX + "sha256:chain1")
                assert erofs_mounts_of(image) == [layer] and refs(shim, blob) == 1  # the sandbox's still
                assert (tmp_path / "sb-root" / "etc" / "motd").read_text() == "base motd\n"
                shim.unmount(sb.id)
            assert erofs_mounts_of(image) == [] and refs(shim, blob) == 0
            assert not linux.is_mount(layer)
    finally:
        shim.close()
