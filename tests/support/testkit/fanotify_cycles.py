"""Making a fanotify-attached layer cold again for restart tests and bench/daemon_restart.py. An
attached blob is never punched (docs/fanotify.md, window 7), so readers that must keep needing
fills across daemon restarts get them the way a node does: the layer unmounted and detached, the
blob evicted, then attached and mounted again (only its metadata present)."""

from __future__ import annotations

from pathlib import Path

from fuse_client.control import attach, detach, request_json
from layerstore.linux import mount_erofs, umount


def remount_cold(cache_dir: Path, blob: str, target: Path, holder: str = "test") -> int:
    """Unmount `target`, detach, evict every chunk of `blob`, attach and mount it again at
    `target`. Nothing may read `target` meanwhile. Returns the bytes evicted."""
    umount(target)
    detach(cache_dir, blob, holder)
    res = request_json(cache_dir, "POST", "/cache/evict", {"blob": blob})
    if res.get("skipped"):
        raise AssertionError(f"blob {blob} still protected after its detach: {res}")
    got = attach(cache_dir, blob, holder)
    if got is None or got.get("data_path") != "fanotify":
        raise AssertionError(f"attach of {blob}: {got}")
    mount_erofs(Path(got["path"]), target)
    return int(res["evicted_bytes"])
