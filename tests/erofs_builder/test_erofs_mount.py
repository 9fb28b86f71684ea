"""EROFS builder against the kernel: build from real directories, mount, compare every entry."""

from __future__ import annotations

import os
import random
import stat
import struct
from pathlib import Path

import pytest
from testkit.erofs_helpers import (
    HAVE_FSCK,
    assert_trees_equal,
    fsck_erofs,
    make_tree,
    mounted_erofs,
    snapshot_tree,
)

from erofs_builder.build import build_layer
from erofs_builder.sources.source_dir import dir_entries

pytestmark = [pytest.mark.root, pytest.mark.skipif(not HAVE_FSCK, reason="needs fsck.erofs")]

# security.capability v2: effective, cap_net_bind_service permitted
CAP_NET_BIND = struct.pack("<IIIII", 0x02000001, 1 << 10, 0, 0, 0)


def build_and_check(src: Path, tmp_path: Path, name: str = "img.erofs", **kw: object) -> Path:
    layer = build_layer(dir_entries(src), tmp_path / name, **kw)  # type: ignore[arg-type]
    fsck_erofs(layer.path)
    with mounted_erofs(layer.path) as mnt:
        assert_trees_equal(snapshot_tree(src), snapshot_tree(mnt))
    return layer.path


def test_everything_kind_of_tree(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    make_tree(src, {
        "empty": b"",
        "one": b"x",
        "small.txt": b"hello world\n" * 30,
        "b4095": os.urandom(4095),
        "b4096": os.urandom(4096),
        "b4097": os.urandom(4097),
        "multi": os.urandom((3 << 20) + 123),
        "dir/sub/deeper/file": b"deep",
        "dir/emptydir": {"dir": True},
        "sym": {"symlink": "small.txt"},
        "longsym": {"symlink": "t/" * 1500},
        "bin/suid": {"data": b"\x7fELF" + os.urandom(9000), "mode": 0o4755},
        "bin/sgid": {"data": b"#!/bin/sh\n", "mode": 0o2711},
        "tmp": {"dir": True, "mode": 0o1777},
        "setgid_dir": {"dir": True, "mode": 0o2775},
        "caps": {"data": b"ping", "mode": 0o755, "xattrs": {"security.capability": CAP_NET_BIND}},
        "opaque": {"dir": True, "xattrs": {"trusted.overlay.opaque": b"y"}},
        "opaque/kept": b"k",
        "x1": {"data": b"1", "xattrs": {"user.shared": b"same value", "user.own1": b"a"}},
        "x2": {"data": b"2", "xattrs": {"user.shared": b"same value", "trusted.t": b"b" * 300}},
        "x3": {"data": os.urandom(20000), "xattrs": {"user.shared": b"same value", "user.big": os.urandom(3000)}},
        "private": {"data": b"secret", "mode": 0o600},
    })
    os.mknod(src / "whiteout", stat.S_IFCHR | 0o000, os.makedev(0, 0))
    os.mknod(src / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    os.mknod(src / "loop", stat.S_IFBLK | 0o660, os.makedev(7, 300))
    os.mknod(src / "fifo", stat.S_IFIFO | 0o644)
    os.mknod(src / "sock", stat.S_IFSOCK | 0o755)
    os.chown(src / "private", 100000, 200000)
    os.chown(src / "one", 65535, 65536)
    os.lchown(src / "sym", 1000, 1000)
    os.link(src / "small.txt", src / "hard1")
    os.link(src / "small.txt", src / "dir/hard2")
    os.link(src / "multi", src / "multi.link")
    os.link(src / "null", src / "null.link")
    (src / os.fsdecode(b"bad-\xff\xfe-name")).write_bytes(b"non-utf8")
    (src / ("n" * 255)).write_bytes(b"long name")
    deep = src
    for i in range(60):
        deep = deep / f"d{i}"
    deep.mkdir(parents=True)
    (deep / "leaf").write_bytes(b"leaf")
    os.utime(src / "small.txt", ns=(0, 1_600_000_000_123_456_789))
    os.utime(src / "b4097", ns=(0, 1))
    os.utime(src / "sym", ns=(0, 1_500_000_000_000_000_000), follow_symlinks=False)
    build_and_check(src, tmp_path)


def test_rebuild_is_byte_identical(tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_tree(src, {f"d{i % 7}/f{i}": os.urandom(i * 97) for i in range(200)})
    a = build_layer(dir_entries(src), tmp_path / "a.img")
    b = build_layer(dir_entries(src), tmp_path / "b.img")
    assert a.blob == b.blob and a.refs == b.refs
    assert a.path.read_bytes() == b.path.read_bytes()
    c = build_layer(dir_entries(src), tmp_path / "c.img", mtime_clamp=1_000_000)
    assert c.blob != a.blob
    fsck_erofs(c.path)
    with mounted_erofs(c.path) as mnt:
        assert {os.lstat(p).st_mtime for p in mnt.rglob("*")} == {1_000_000}


def test_multi_block_directory(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    names = [f"{i:05d}-{'x' * (i % 200)}" for i in range(3000)]
    for n in names:
        (src / n).write_bytes(n.encode()[:40])
    (src / "a-subdir").mkdir()
    img = build_and_check(src, tmp_path)
    with mounted_erofs(img) as mnt:
        for n in names[::7] + ["a-subdir"]:
            assert os.path.exists(mnt / n)
        assert not os.path.exists(mnt / "00001-nope")
        assert len(os.listdir(mnt)) == len(names) + 1


def test_sparse_file_over_4gib(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    size = (5 << 30) + 4321
    marks = {0: b"head", 1 << 30: os.urandom(10000), (4 << 30) + 12345: b"middle", size - 5: b"tail!"}
    with open(src / "sparse", "wb") as f:
        f.truncate(size)
        for off, data in marks.items():
            f.seek(off)
            f.write(data)
    with open(src / "all-hole", "wb") as f:
        f.truncate(3 << 30)
    layer = build_layer(dir_entries(src), tmp_path / "img")
    assert layer.size < 4 << 20, "holes must not be stored"
    fsck_erofs(layer.path)
    with mounted_erofs(layer.path) as mnt:
        st = os.stat(mnt / "sparse")
        assert st.st_size == size
        fd = os.open(mnt / "sparse", os.O_RDONLY)
        try:
            for off, data in marks.items():
                assert os.pread(fd, len(data), off) == data
            assert os.pread(fd, 100, (2 << 30) + 7) == bytes(100)
            assert os.pread(fd, 10, size) == b""
        finally:
            os.close(fd)
        assert os.stat(mnt / "all-hole").st_size == 3 << 30
        with open(mnt / "all-hole", "rb") as f:
            f.seek(2 << 30)
            assert f.read(1 << 16) == bytes(1 << 16)


def test_sparse_file_small_holes(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "holey", "wb") as f:
        f.truncate(40 << 20)
        for i in range(0, 40 << 20, 3 << 20):
            f.seek(i + 1000)
            f.write(os.urandom(5000))
    build_and_check(src, tmp_path)


def test_pack_tails_variants(tmp_path: Path) -> None:
    """Tails up to half a block are packed by default; True packs any that fits, False none."""
    src = tmp_path / "src"
    make_tree(src, {f"f{i}": os.urandom(4096 * (i % 3) + i * 67) for i in range(1, 60)})
    plain = build_and_check(src, tmp_path, "plain.img", pack_tails=False)
    half = build_and_check(src, tmp_path, "half.img")
    packed = build_and_check(src, tmp_path, "packed.img", pack_tails=True)
    assert packed.stat().st_size <= half.stat().st_size < plain.stat().st_size


def test_many_groups_of_every_kind_of_record(tmp_path: Path) -> None:
    """Enough records of every kind (addressed, stable, directories) for several content-defined
    groups of each, with xattrs: the kernel sees the tree as it is, and every group starts on a
    block."""
    rnd = random.Random(171)  # fixed: content-defined groups of random bytes vary from run to run
    spec: dict[str, object] = {}
    for d in range(300):  # directories: several groups
        spec[f"d{d:03d}/small"] = rnd.randbytes(d % 900)  # stable (inline)
        spec[f"d{d:03d}/tail"] = rnd.randbytes(4096 + 100 + d)  # addressed, its tail packed
        spec[f"d{d:03d}/x"] = {"data": b"x" * (d % 50), "xattrs": {"user.k": rnd.randbytes(200 + d)}}
    spec["big/xattrs"] = {"data": rnd.randbytes(9000), "xattrs": {"user.big": rnd.randbytes(3900)}}
    make_tree(tmp_path / "src", spec)  # type: ignore[arg-type]
    # Times are in the inodes, so in the metadata groups' content: fixed, so the cuts are too.
    for dirpath, dirs, files in os.walk(tmp_path / "src", topdown=False):
        for name in [*files, *dirs, ""]:
            os.utime(os.path.join(dirpath, name), ns=(10**18, 10**18), follow_symlinks=False)
    layer = build_layer(dir_entries(tmp_path / "src"), tmp_path / "img")
    assert layer.layout is not None
    groups = [s for s in layer.layout.meta if s.grouped or s.stable]
    for kind in ((False, False), (True, False), (False, True)):  # addressed, stable, directories
        assert sum(1 for s in groups if (s.stable, s.dirs) == kind) >= 2, kind
    assert all(s.offset % 4096 == 0 for s in groups)
    fsck_erofs(layer.path)
    with mounted_erofs(layer.path) as mnt:
        assert_trees_equal(snapshot_tree(tmp_path / "src"), snapshot_tree(mnt))
