"""Images from in-memory entries: tar-like orders, whiteouts, refused input."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
from testkit.erofs_helpers import (
    assert_trees_equal,
    expected_snapshot,
    fsck_erofs,
    mounted_erofs,
    needs_mount,
    snapshot_tree,
)

from erofs_builder.build import build_layer
from erofs_builder.erofs.writer import ImageWriter
from erofs_builder.tree import Entry, Hole, Kind
from layerstore.errors import BadInput


def feed(entries: list[tuple[Entry, bytes | None]]) -> list[tuple[Entry, list[bytes] | None]]:
    return [(e, None if d is None else [d[i:i + 7000] for i in range(0, len(d), 7000)]) for e, d in entries]


def check(entries: list[tuple[Entry, bytes | None]], tmp_path: Path, **kw: object) -> Path:
    layer = build_layer(feed(entries), tmp_path / "img", **kw)  # type: ignore[arg-type]
    fsck_erofs(layer.path)
    with mounted_erofs(layer.path) as mnt:
        assert_trees_equal(expected_snapshot(entries, **kw), snapshot_tree(mnt))  # type: ignore[arg-type]
    return layer.path


@needs_mount
def test_tar_like_order_whiteouts_and_opaque(tmp_path: Path) -> None:
    big = os.urandom(70000)
    entries: list[tuple[Entry, bytes | None]] = [
        (Entry(b"usr/bin/tool", Kind.REG, mode=0o4755, uid=0, gid=50, mtime=1_700_000_000, size=len(big)), big),
        (Entry(b"usr", Kind.DIR, mode=0o755, mtime=1_700_000_001), None),  # parent after its child
        (Entry(b"usr/bin/alias", Kind.REG, hardlink=b"usr/bin/tool"), None),
        (Entry(b"etc/.wh.gone", Kind.CHR, mode=0, rdev=(0, 0)), None),
        (Entry(b"etc/gone", Kind.CHR, mode=0, rdev=(0, 0), mtime=5), None),  # overlay whiteout
        (Entry(b"opt", Kind.DIR, mode=0o755, xattrs={b"trusted.overlay.opaque": b"y"}), None),
        (Entry(b"opt/new", Kind.REG, size=3, uid=70000, gid=80000, mtime=1, mtime_nsec=999_999_999), b"new"),
        (Entry(b"link", Kind.SYMLINK, mode=0o777, symlink=b"usr/bin/tool"), None),
        (Entry(b"dev/sda", Kind.BLK, mode=0o660, gid=6, rdev=(8, 0)), None),
        (Entry(b"dev/big", Kind.CHR, mode=0o600, rdev=(4095, 1048575)), None),
        (Entry(b"run/fifo", Kind.FIFO, mode=0o600), None),
        (Entry(b"run/sock", Kind.SOCK, mode=0o777), None),
        (Entry(b"\xff\xfe" + b"n" * 253, Kind.REG, size=1), b"z"),
        (Entry(b"", Kind.DIR, mode=0o700, mtime=42), None),  # explicit root late
        (Entry(b"acl", Kind.REG, size=0, xattrs={
            b"system.posix_acl_access": bytes.fromhex("02000000" "01000600ffffffff" "04000400ffffffff"
                                                      "20000400ffffffff")}), b""),
    ]
    check(entries, tmp_path)


@needs_mount
def test_clamp_and_all_root(tmp_path: Path) -> None:
    entries: list[tuple[Entry, bytes | None]] = [
        (Entry(b"a", Kind.REG, uid=5, gid=6, mtime=2_000_000_000, mtime_nsec=5, size=2), b"ab"),
        (Entry(b"b/c", Kind.REG, uid=100000, mtime=10, size=0), b""),
    ]
    check(entries, tmp_path, mtime_clamp=1_000_000_000, all_root=True)


@needs_mount
def test_sparse_data_from_holes(tmp_path: Path) -> None:
    data = [b"abc", Hole(10 << 20), b"x" * 9000, Hole(100), b"end"]
    size = 3 + (10 << 20) + 9000 + 100 + 3
    layer = build_layer([(Entry(b"s", Kind.REG, size=size), data)], tmp_path / "img")
    assert layer.size < 1 << 20
    fsck_erofs(layer.path)
    with mounted_erofs(layer.path) as mnt:
        got = (mnt / "s").read_bytes()
    assert got == b"abc" + bytes(10 << 20) + b"x" * 9000 + bytes(100) + b"end"


def _writer() -> ImageWriter:
    return ImageWriter(io.BytesIO())


@pytest.mark.parametrize("entries, message", [
    ([Entry(b"a", Kind.DIR), Entry(b"a", Kind.DIR)], "duplicate"),
    ([Entry(b"s", Kind.SYMLINK, symlink=b"x"), Entry(b"s/f", Kind.REG)], "not a directory"),
    ([Entry(b"f", Kind.REG), Entry(b"f/g/h", Kind.REG)], "not a directory"),
    ([Entry(b"h", Kind.REG, hardlink=b"missing")], "missing"),
    ([Entry(b"d", Kind.DIR), Entry(b"h", Kind.REG, hardlink=b"d")], "directory"),
    ([Entry(b"d/x", Kind.REG), Entry(b"d", Kind.REG)], "already a directory"),
    ([Entry(b"a/../b", Kind.REG)], "component"),
    ([Entry(b"/abs", Kind.REG)], "normalised"),
    ([Entry(b"n" * 256, Kind.REG)], "longer than"),
    ([Entry(b"nul\0", Kind.REG)], "NUL"),
    ([Entry(b"x", Kind.REG, xattrs={b"system.other": b"1"})], "prefix"),
    ([Entry(b"x", Kind.SYMLINK)], "target"),
    ([Entry(b"", Kind.REG)], "root"),
])
def test_refused_input(entries: list[Entry], message: str) -> None:
    w = _writer()
    with pytest.raises(BadInput, match=message):
        for e in entries:
            w.add(e, [] if e.kind is Kind.REG else None)


@pytest.mark.parametrize("size, data", [
    (5, [b"abcd"]), (5, [b"abcdef"]), (10000, [b"a" * 9999]), (10000, [b"a" * 10001]),
    (10000, [Hole(10001)]), (3, None), (0, [b"x"]),
])
def test_size_mismatch_is_refused(size: int, data: list[bytes | Hole] | None) -> None:
    with pytest.raises(BadInput, match="'f'"):
        _writer().add(Entry(b"f", Kind.REG, size=size), data)


def test_symlink_with_data_is_refused() -> None:
    with pytest.raises(BadInput):
        _writer().add(Entry(b"l", Kind.SYMLINK, symlink=b"t"), [b"data"])
