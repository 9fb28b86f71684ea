"""A small real multi-layer OCI image built from busybox, as an OCI layout, a `docker save`
archive, or pushed to a registry with `erofs_builder.sources.registry` (no tests here).

The image (`busybox_spec`), three layers:
  0  (gzip)  a busybox rootfs (testkit.shim_support.busybox_rootfs), every file root's
  1  (zstd)  /opt/tool/greet (a script) and a replaced /etc/motd
  2  (plain) /work/task.txt and a whiteout of /etc/motd
and a config with Entrypoint ["/opt/tool/greet"], Cmd ["from-cmd"], Env (PATH, GREETING),
WorkingDir /work, User nobody (65534 in its /etc/passwd). Run as is, it prints `EXPECTED_OUTPUT`.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

from erofs_builder.sources.registry import OCI_MANIFEST, RegistryClient

from .archive_factory import MTIME, ImageSpec, Layer, layer_tar, write_docker_archive, write_oci_layout
from .shim_support import busybox_rootfs

GREET = b"""#!/bin/sh
echo "$GREETING in $(pwd) as $(id -u) args: $*"
cat /work/task.txt
if test -e /etc/motd; then echo motd-present; else echo motd-gone; fi
"""
CONFIG = {"Entrypoint": ["/opt/tool/greet"], "Cmd": ["from-cmd"],
          "Env": ["PATH=/opt/tool:/bin", "GREETING=hello-from-image"], "WorkingDir": "/work", "User": "nobody"}
EXPECTED_OUTPUT = "hello-from-image in /work as 65534 args: from-cmd\ntask 17\nmotd-gone\n"


def rootfs_tar(src: Path) -> bytes:
    """A directory as a layer tar, sorted, every member root's with a fixed mtime."""
    def owner(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = MTIME
        return info

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        tf.add(src, arcname=".", filter=owner)
    return buf.getvalue()


def busybox_spec(work: Path) -> ImageSpec:
    """The image described above; `work` is a scratch directory for the rootfs."""
    base = rootfs_tar(busybox_rootfs(work / "busybox-rootfs"))
    tool = layer_tar([("dir", "opt", 0o755), ("dir", "opt/tool", 0o755), ("file", "opt/tool/greet", GREET),
                      ("dir", "etc", 0o755), ("file", "etc/motd", b"toolkit motd\n")])
    tool = _chmod(tool, "opt/tool/greet", 0o755)
    top = layer_tar([("dir", "work", 0o755), ("file", "work/task.txt", b"task 17\n"),
                     ("dir", "etc", 0o755), ("file", "etc/.wh.motd", b"")])
    return ImageSpec([Layer(base, "gzip"), Layer(tool, "zstd"), Layer(top, "none")], config=dict(CONFIG))


def _chmod(tar: bytes, name: str, mode: int) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(tar)) as src, \
            tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as dst:
        for info in src:
            data = src.extractfile(info) if info.isreg() else None
            if info.name == name:
                info.mode = mode
            dst.addfile(info, data)
    return out.getvalue()


def busybox_layout(root: Path, work: Path, ref: str = "latest") -> dict[str, str]:
    """The image as an OCI layout at `root`; returns write_oci_layout's digests."""
    return write_oci_layout(root, busybox_spec(work), ref=ref)


def busybox_archive(path: Path, work: Path, tag: str = "example/busybox:1") -> Path:
    """The image as a `docker save` archive."""
    return write_docker_archive(path, busybox_spec(work), tag=tag)


def push_layout(layout: Path, registry: str, repo: str, tag: str, **client: object) -> str:
    """Push the one image of an OCI layout written by `write_oci_layout` (its blobs, then its
    manifest under `tag`); returns the manifest digest. `client`: RegistryClient keywords."""
    index = json.loads((layout / "index.json").read_text())
    mdigest = index["manifests"][0]["digest"]
    blobs = layout / "blobs" / "sha256"
    body = (blobs / mdigest.split(":")[1]).read_bytes()
    manifest = json.loads(body)
    with RegistryClient(registry, **client) as reg:  # type: ignore[arg-type]
        for desc in [manifest["config"], *manifest["layers"]]:
            reg.push_blob(repo, blobs / desc["digest"].split(":")[1], desc["digest"])
        return reg.put_manifest(repo, tag, body, manifest.get("mediaType", OCI_MANIFEST))


def push_busybox(root: Path, registry: str, repo: str = "test/busybox", tag: str = "1", **client: object) -> str:
    """Build the busybox image under `root` and push it; returns the manifest digest."""
    layout = root / "layout"
    busybox_layout(layout, root / "work")
    return push_layout(layout, registry, repo, tag, **client)
