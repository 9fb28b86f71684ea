"""Layer images a VM maps through virtio-pmem (NODE/vm/pmem/): one per layer blob on a node,
shared by every VM of the node that has the layer (docs/vm-memory.md).

QEMU maps a pmem device's backing file (shared, read-only) into guest memory, so the guest's
EROFS reads the host's page cache directly (DAX) and every VM on the node reads the same host
pages. Two things stop that from being the blob file the node's layer mount reads:

- the size: the guest maps the device in 2 MiB sections ("misaligned, unable to map" otherwise)
  and QEMU maps exactly `size` bytes of a file at least that large; a blob is any size;
- completeness: a mapped page that cannot be read is a SIGBUS in QEMU, the whole VM, not an
  EIO in the guest as on virtio-blk; the node daemon's lazily fetched file can fail a read (the
  daemon restarting, the store away).

So the image is a complete local copy of the blob, padded with zeros to the next multiple of
2 MiB: `<hex digest>.img`. Content addressing is kept: the image is named by the blob's id, its
first `size(blob)` bytes are the blob, and the zeros after them are past the EROFS image's last
block, which the guest never reads. The bytes come from the node's layer source (the daemon's
file, whose every chunk the daemon checks against the blob's chunk map as it fetches it, or the
pinned cache file of a complete, checked blob): a blob id is the hash of the blob's chunk map
(`layerstore.chunkmap.blob_id`), not of its bytes, so the copy is as trusted as the node's own
layer mount of the blob and is not hashed again here. The source must start with an EROFS
superblock (a cheap check that it is a layer image at all). Copying from the daemon's file
fetches whatever of the blob was not cached yet: a pmem layer is fetched whole before the VM
boots.

Crash safety: written to a temporary name beside it, fsynced, renamed, the directory fsynced;
one writer per image (an flock on `<hex>.lock`, released if the writer dies), so sandboxes of
the same layer started together copy it once. A crash leaves at most a temporary file, which
the next copy of that blob does not reuse (its name is unique) and `sweep` removes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from pathlib import Path

from erofs_builder.erofs import format as fmt
from layerstore import digest as digestmod
from layerstore.fileio import fsync_dir

from ..errors import ShimError
from .spec import PMEM_ALIGN

COPY_CHUNK = 1 << 20


def padded(size: int) -> int:
    """The pmem size of a blob of `size` bytes: the next multiple of PMEM_ALIGN (at least one)."""
    return max(PMEM_ALIGN, -(-size // PMEM_ALIGN) * PMEM_ALIGN)


def image_path(directory: Path, blob: str) -> Path:
    return directory / f"{digestmod.hex_of(blob)}.img"


def pmem_image(directory: Path, blob: str, source: str | os.PathLike[str]) -> tuple[Path, int]:
    """The node's pmem image of `blob`, copied from `source` (the node's checked file of the blob:
    see the module docstring) unless it is there; (its path, its size: a multiple of PMEM_ALIGN).
    `ShimError` if `source` cannot be read or holds no EROFS image."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = image_path(directory, blob)
    with contextlib.suppress(FileNotFoundError):
        return path, _checked_size(path)
    fd = os.open(directory / f"{path.stem}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # one copy per image; the others wait for it
        with contextlib.suppress(FileNotFoundError):
            return path, _checked_size(path)
        return path, _copy(blob, source, path)
    finally:
        os.close(fd)


def _checked_size(path: Path) -> int:
    size = path.stat().st_size
    if size <= 0 or size % PMEM_ALIGN:
        raise ShimError(f"{path}: {size} bytes, not a multiple of {PMEM_ALIGN} (not a pmem image; remove it)")
    return size


def _copy(blob: str, source: str | os.PathLike[str], path: Path) -> int:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        n = 0
        try:
            with open(source, "rb", buffering=0) as src:
                head = os.pread(src.fileno(), 4, fmt.SUPER_OFFSET)
                if head != fmt.MAGIC.to_bytes(4, "little"):
                    raise ShimError(f"layer {blob}: {source} holds no EROFS image")
                while chunk := src.read(COPY_CHUNK):
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(fd, view):]
                    n += len(chunk)
        except OSError as e:  # (the daemon's file: a fetch that failed; the node disk full)
            raise ShimError(f"layer {blob}: cannot make its pmem image from {source}: {e}") from None
        size = padded(n)
        os.ftruncate(fd, size)  # the zeros after the blob: a hole, never read by the guest
        os.fsync(fd)
        os.fchmod(fd, 0o644)  # QEMU opens it after dropping to its unprivileged user
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
        fsync_dir(path.parent)
        return size
    finally:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def sweep(directory: Path) -> list[Path]:
    """Remove the temporaries of copies that died (names starting with '.', whose lock is free)."""
    gone = []
    with contextlib.suppress(FileNotFoundError):
        for p in directory.iterdir():
            if not (p.name.startswith(".") and p.name.endswith(".tmp")):
                continue
            stem = p.name[1:].split(".img.", 1)[0]
            fd = os.open(directory / f"{stem}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a copy of that blob is being made
                p.unlink(missing_ok=True)
                gone.append(p)
            finally:
                os.close(fd)
    return gone
