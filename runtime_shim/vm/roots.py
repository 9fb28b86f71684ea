"""Flattened root devices for full VMs, one per layer stack on a node (NODE/vm/roots/).

A full VM boots from one root device: the multi-device EROFS metadata image over the layer blobs
(`erofs_builder.flatten.build_multidevice`; docs/vm-flattened.md says why that one). The image is
derived data: a function of the layer blobs (bottom first) alone, so every sandbox of the same
layer stack on the node shares one, built on first use from the layers' metadata only.

The guest finds the layers because the image's device table names them: the 6.1 guest kernel
opens an extra device by its tag when the mount gives no `device=` option, and the VM gets the
root as its first virtio-blk drive (vda) and the layers next, in order (vdb, vdc, ...): the tags
are those paths. (A 6.12+ kernel without `device=` reads the image as one flat device instead and
fails on the first data read, never returning wrong bytes: see `flatten`.)

Crash safety: the image is written to a temporary name and renamed into place (flatten._atomic),
by one builder at a time per image (an flock on NODE/vm/roots/<key>.lock, released if it dies):
the sandboxes of a stack started together wait for the first one's image.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Sequence
from pathlib import Path

import blake3

from erofs_builder.flatten import MAX_DEVICES, FlattenResult, build_multidevice
from layerstore.errors import BadInput

FORMAT = b"layerstore-vm-root-v1\0"
FIRST_LAYER_DRIVE = 1  # the root is drive 0 (vda), the layers follow


def guest_device(index: int) -> str:
    """The guest's name of virtio-blk drive `index` (0 -> /dev/vda, 26 -> /dev/vdaa)."""
    name = ""
    n = index + 1
    while n:
        n, r = divmod(n - 1, 26)
        name = chr(ord("a") + r) + name
    return f"/dev/vd{name}"


def root_key(blobs: Sequence[str]) -> str:
    h = blake3.blake3(FORMAT)
    for b in blobs:
        h.update(b.encode() + b"\0")
    return h.hexdigest()[:32]


def layer_tags(count: int) -> list[bytes]:
    return [guest_device(FIRST_LAYER_DRIVE + i).encode() for i in range(count)]


def root_image(roots: Path, blobs: Sequence[str],
               sources: Sequence[str | os.PathLike[str]]) -> tuple[Path, FlattenResult | None]:
    """The root image for `blobs` (bottom first) whose files are `sources`, built unless the node
    has it; (its path, the build's figures or None if it was there)."""
    if len(blobs) != len(sources) or not blobs:
        raise BadInput("one source file per layer blob, at least one layer")
    if len(blobs) > MAX_DEVICES:
        raise BadInput(f"{len(blobs)} layers: a VM root takes at most {MAX_DEVICES}")
    roots.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = root_key(blobs)
    path = roots / f"{key}.erofs"
    if path.is_file():
        return path, None
    # one builder per image: sandboxes of the same stack started at once wait for it instead of
    # each building the same bytes (flock: released if the builder dies)
    fd = os.open(roots / f"{key}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if path.is_file():
            return path, None
        return path, build_multidevice(sources, path, tags=layer_tags(len(blobs)))
    finally:
        os.close(fd)
