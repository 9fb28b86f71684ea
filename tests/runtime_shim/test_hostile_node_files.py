"""Issue 27, the node's own files: an unprivileged local user (uid 65534, in a child that drops
root with setgroups/setgid/setuid) tries to read a private environment's secrets through the
node's files -- the blobs on the FUSE mount, the cache's data files and index, the shim's state,
a kept sandbox's upper (its image and its files), the layer mounts and the sandbox's root -- on
a node directory an administrator (or an older version) made 0755, under a world-searchable
parent. Every attempt is refused. Also the FUSE mount itself, outside any node directory: only
the daemon's user (and a configured control group) may open a blob."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest
from testkit.fuse_helpers import DaemonThread, build_and_push, make_tree
from testkit.shim_support import cleanup_node, needs_root, store_with_env

from fuse_client.nodecache.files import BlobFiles
from layerstore.backends.posix import PosixBackend
from layerstore.store import Store
from runtime_shim.node.request import MountRequest
from runtime_shim.node.shim import Shim
from runtime_shim.nodestate.paths import NodePaths

pytestmark = [pytest.mark.hostile, needs_root]

NOBODY = 65534
OTHER_GID = 54321  # a group nobody is in by default
SECRET = b"TOPSECRET-27-"

# Runs as root, drops to uid 65534 (gid and supplementary groups from argv), then tries every path
# of argv: a directory is listed, a file opened and read. Prints {path: "ok" | errno}.
READER = r"""
import json, os, sys
gid, groups = int(sys.argv[1]), [int(g) for g in sys.argv[2].split(",") if g]
os.setgroups(groups)
os.setgid(gid)
os.setuid(65534)
out = {}
for p in sys.argv[3:]:
    try:
        if os.path.isdir(p):
            os.listdir(p)
        else:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.read(fd, 1)
            finally:
                os.close(fd)
        out[p] = "ok"
    except OSError as e:
        out[p] = e.errno
print(json.dumps(out))
"""


def as_nobody(paths: list[Path], gid: int = NOBODY, groups: tuple[int, ...] = ()) -> dict[str, object]:
    r = subprocess.run([sys.executable, "-c", READER, str(gid), ",".join(map(str, groups)), *map(str, paths)],
                       capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    backend = PosixBackend(tmp_path / "store", fsync=False)
    backend.create()
    s = Store(backend)
    s.init()
    return s


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every user can search (pytest's own tmp dirs are 0700: they would hide the
    node from the attacker and prove nothing)."""
    d = Path(tempfile.mkdtemp(prefix="ls27-", dir="/tmp"))
    try:
        d.chmod(0o755)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _secret_tree(root: Path) -> Path:
    make_tree(root, small=4, big=(256 << 10,))
    (root / "secret.env").write_bytes(SECRET + b"layer\n")
    (root / "secret.env").chmod(0o644)  # (a layer's own modes: the node must not rely on them)
    return root


# -- the FUSE mount alone --------------------------------------------------------------------------
@pytest.mark.parametrize("group", [None, OTHER_GID])
def test_another_user_cannot_open_a_blob_on_the_fuse_mount(store: Store, open_dir: Path, tmp_path: Path,
                                                           group: int | None) -> None:
    """The mount outside any node directory (mountpoint and cache under a 0755 directory, the
    cache made 0755 beforehand): without a control group nobody else reaches the mount at all;
    with one, its members read blobs (container and VM backends that need group access) and
    other users still do not. Root reads the blob either way (the EROFS mounts are root's)."""
    layer = build_and_push(store, _secret_tree(tmp_path / "src"), tmp_path / "image.erofs")
    cache, mnt = open_dir / "cache", open_dir / "mnt"
    cache.mkdir(mode=0o755)
    cache.chmod(0o755)
    mnt.mkdir(mode=0o755)
    cfg = {} if group is None else {"control_group": str(group)}
    with DaemonThread(store, cache, mnt, **cfg) as d:
        blob = d.blob(layer.blob)
        assert blob.read_bytes() == layer.path.read_bytes()  # root: the data is there, and cached now
        data_file = BlobFiles(cache).path(layer.blob)
        assert data_file.exists()
        targets = [blob, mnt / "blobs", mnt, data_file, data_file.parent, cache / "index" / "data.mdb", cache]
        got = as_nobody(targets)
        assert all(v == errno.EACCES for v in got.values()), got
        assert stat.S_IMODE(cache.stat().st_mode) == (0o700 if group is None else 0o710)
        if group is not None:  # a member of the control group reads blobs, and only blobs
            member = as_nobody(targets, NOBODY, (OTHER_GID,))
            assert member[str(blob)] == "ok" and member[str(mnt / "blobs")] == "ok", member
            assert all(member[str(p)] == errno.EACCES for p in targets[3:6]), member
            assert os.stat(blob).st_mode & 0o777 == 0o440


# -- a whole node, its directory made 0755 beforehand ------------------------------------------------
@contextlib.contextmanager
def node_shim(parent: Path, store_url: str) -> Iterator[Shim]:
    node = parent / "node"
    try:
        with Shim.for_node(node, store_url) as s:
            yield s
    finally:
        cleanup_node(node, parent)


def test_another_user_reads_nothing_of_a_node_dir_made_0755(open_dir: Path, tmp_path: Path) -> None:
    """The attack of issue 27 on a real node (store, daemon, a kept sandbox with a secret in its
    upper): NODE and its directories existed 0755 (by hand, or an older version), NODE/state held
    a database made 0644. The shim narrows them all to 0700 and the daemon's mount admits no other
    user; uid 65534 reads no blob, cache file, index, state, upper, layer or root."""
    url = store_with_env(tmp_path, _secret_tree(tmp_path / "src"))
    node = open_dir / "node"
    paths = NodePaths(node)
    for d in (node, paths.state, paths.cache, paths.fuse, paths.layers, paths.locks, paths.sandboxes, paths.roots):
        d.mkdir(mode=0o755)
        d.chmod(0o755)
    lmdb.open(str(paths.state), mode=0o644).close()  # (an older version's database: 0644 files)
    assert stat.S_IMODE((paths.state / "data.mdb").stat().st_mode) == 0o644
    with node_shim(open_dir, url) as shim:
        sb = shim.mount(MountRequest("bb:1", sandbox="victim", upper_image=64 << 20))
        root = Path(sb.target)
        (root / "upper-secret.env").write_bytes(SECRET + b"upper\n")
        (root / "upper-secret.env").chmod(0o644)
        blob = sb.layers[0]
        layer_mount = paths.layer_mount(blob)
        targets = [
            paths.fuse / "blobs" / blob, paths.fuse / "blobs", paths.fuse,
            BlobFiles(paths.cache).path(blob), paths.cache / "index" / "data.mdb", paths.cache,
            paths.state / "data.mdb", paths.state,
            paths.upper_image("victim"), Path(sb.upper) / "upper-secret.env", paths.sandbox_dir("victim"),
            layer_mount / "secret.env", layer_mount,
            root / "secret.env", root / "upper-secret.env", paths.roots,
            node,
        ]
        for p in targets:
            assert p.exists(), p  # (root sees them: the attack aims at real files)
        got = as_nobody(targets)
        assert all(v == errno.EACCES for v in got.values()), got
        for d in (node, paths.state, paths.cache, paths.layers, paths.locks, paths.sandboxes, paths.roots):
            assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
        for f in (paths.state / "data.mdb", paths.cache / "index" / "data.mdb"):
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
        shim.unmount("victim")
