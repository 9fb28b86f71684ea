"""Parent images: a build on an earlier image of the same tree keeps its addresses.

The kernel and fsck.erofs judge every parent-built image; it must show exactly what a fresh
build of the same tree shows, rebuild byte for byte from the same input and parent, and share
every chunk of the parent that holds nothing that changed.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
from testkit.cli_helpers import layerctl
from testkit.erofs_helpers import (
    HAVE_FSCK,
    HAVE_ROOT,
    assert_trees_equal,
    fsck_erofs,
    make_tree,
    mounted_erofs,
    needs_mount,
    snapshot_tree,
)

from erofs_builder.build import BuiltLayer, build_layer
from erofs_builder.erofs.parent import read_parent
from erofs_builder.erofs.reuse import chunk_bits
from erofs_builder.sources.source_dir import dir_entries
from layerstore.errors import BadInput

MiB = 1 << 20
CLAMP = 1_700_000_000


def rich_tree(root: Path) -> None:
    make_tree(root, {
        "README": b"readme\n" * 20,
        "empty": b"",
        "big.bin": os.urandom(3 * MiB + 777),
        "log.txt": os.urandom(200_000),
        "tail.txt": os.urandom(9000),
        "lib/a.py": b"import os\n" * 50,
        "lib/b.py": os.urandom(40_000),
        "lib/sub/c.py": b"c" * 3000,
        "lib/sub/gone.py": b"to be removed",
        "sym": {"symlink": "lib/a.py"},
        "longsym": {"symlink": "x/" * 1500},
        "x1": {"data": b"1", "xattrs": {"user.shared": b"v", "user.own": b"a"}},
        "x2": {"data": b"2", "xattrs": {"user.shared": b"v"}},
        "opaque": {"dir": True, "xattrs": {"trusted.overlay.opaque": b"y"}},
        "bin/suid": {"data": os.urandom(10_000), "mode": 0o4755},
        **{f"many/{i:04d}-{'n' * (i % 60)}": os.urandom(i * 7) for i in range(400)},
    })
    os.link(root / "lib/a.py", root / "lib/a-link.py")
    os.mknod(root / "whiteout", stat.S_IFCHR, os.makedev(0, 0))
    os.mknod(root / "fifo", stat.S_IFIFO | 0o600)
    with open(root / "sparse", "wb") as f:
        f.truncate(40 * MiB)
        f.seek(20 * MiB)
        f.write(os.urandom(5000))


def next_release(root: Path) -> None:
    """The changes a release makes: edits, growth, removals, additions, new metadata."""
    with open(root / "big.bin", "r+b") as f:  # one block in the middle changes
        f.seek(MiB + 10)
        f.write(b"patched")
    with open(root / "log.txt", "ab") as f:  # appended to
        f.write(b"more lines\n" * 500)
    (root / "tail.txt").write_bytes(os.urandom(9100))
    (root / "lib/a.py").write_bytes(b"import sys\n" * 50)  # a hard-linked file changes
    os.unlink(root / "lib/sub/gone.py")
    (root / "lib/sub/new.py").write_bytes(b"new file")
    (root / "NEWS").write_bytes(b"top-level addition")
    for i in range(400, 700):  # the directory outgrows its block
        (root / f"many/{i:04d}-{'m' * (i % 90)}").write_bytes(os.urandom(i % 5000))
    os.chmod(root / "README", 0o600)
    os.setxattr(root / "tail.txt", "user.shared", b"v")
    os.setxattr(root / "lib/b.py", "user.other", b"w")
    os.setxattr(root / "README", "user.other", b"w")
    os.unlink(root / "sym")
    os.symlink("lib/b.py", root / "sym")
    (root / "lib/sub").rename(root / "lib/renamed")


def clamp(root: Path) -> None:
    for p in [root, *root.rglob("*")]:
        os.utime(p, (CLAMP, CLAMP), follow_symlinks=False)


def build(src: Path, out: Path, **kw: object) -> BuiltLayer:
    return build_layer(dir_entries(src), out, **kw)  # type: ignore[arg-type]


@needs_mount
def test_parent_built_image_mounts_like_a_fresh_build(tmp_path: Path) -> None:
    src = tmp_path / "src"
    rich_tree(src)
    clamp(src)
    layers = [build(src, tmp_path / "r0.img")]
    for gen in range(1, 4):
        if gen == 1:
            next_release(src)
        else:
            (src / f"gen{gen}").write_bytes(os.urandom(gen * 5000))
        with open(src / "log.txt", "ab") as f:
            f.write(os.urandom(gen * 3000))
        clamp(src)
        layer = build(src, tmp_path / f"r{gen}.img", parent=layers[-1])
        assert layer.parent_used
        fresh = build(src, tmp_path / f"fresh{gen}.img")
        fsck_erofs(layer.path)
        with mounted_erofs(layer.path) as mnt:
            assert_trees_equal(snapshot_tree(src), snapshot_tree(mnt))
        with mounted_erofs(fresh.path) as mnt:
            assert_trees_equal(snapshot_tree(src), snapshot_tree(mnt))
        again = build(src, tmp_path / f"again{gen}.img", parent=layers[-1])
        assert again.blob == layer.blob and again.refs == layer.refs  # same input + same parent
        layers.append(layer)


def test_unchanged_files_keep_their_chunks(tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_tree(src, {f"pkg/m{i // 50}/f{i:04d}.py": os.urandom(300 + (i * 131) % 20_000) for i in range(2000)})
    (src / "big").write_bytes(os.urandom(5 * MiB))
    clamp(src)
    a = build(src, tmp_path / "a.img")
    (src / "pkg/m3/f0170.py").write_bytes(b"changed")
    (src / "pkg/m20/f1010.py").write_bytes(os.urandom(30_000))
    (src / "pkg/m20/added.py").write_bytes(os.urandom(5000))
    clamp(src)
    b = build(src, tmp_path / "b.img", parent=a)
    fresh = build(src, tmp_path / "fresh.img")
    old = {r.digest for r in a.refs}
    data_a = [r for r in a.refs if not r.metadata]
    assert {r.digest for r in data_a} <= {r.digest for r in b.refs}  # every data chunk of the parent
    new = sum(r.length for r in b.refs if r.digest not in old)
    fresh_new = sum(r.length for r in fresh.refs if r.digest not in old)
    changed = 7 + 30_000 + 5000
    assert new < changed + 400_000, new  # the files, their records and directories' chunks
    assert new * 5 < fresh_new, (new, fresh_new)
    assert a.layout is not None and b.layout is not None
    assert b.layout.extra["kept_records"] >= 0.99 * a.layout.extra["records"]


def test_changed_file_keeps_its_unchanged_blocks(tmp_path: Path) -> None:
    src = tmp_path / "src"
    data = bytearray(os.urandom(4 * MiB + 100))
    make_tree(src, {"data.bin": bytes(data)})
    a = build(src, tmp_path / "a.img")
    data[3 * MiB + 5:3 * MiB + 9] = b"EDIT"
    data += b"appended"
    (src / "data.bin").write_bytes(bytes(data))
    os.utime(src / "data.bin", (0, 0))
    os.utime(src, (0, 0))
    b = build(src, tmp_path / "b.img", parent=a)
    old = {r.digest for r in a.refs}
    assert sum(r.length for r in b.refs if r.digest not in old) < 300_000
    if HAVE_ROOT and HAVE_FSCK:
        fsck_erofs(b.path)
        with mounted_erofs(b.path) as mnt:
            assert (mnt / "data.bin").read_bytes() == bytes(data)


def test_a_parent_with_too_much_dead_data_is_set_aside(tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_tree(src, {f"f{i}": os.urandom(50_000) for i in range(20)})
    a = build(src, tmp_path / "a.img")
    for i in range(12):  # most of the content changes
        (src / f"f{i}").write_bytes(os.urandom(50_000))
    b = build(src, tmp_path / "b.img", parent=a)
    assert b.parent_used  # the parent itself has no dead data
    c = build(src, tmp_path / "c.img", parent=b)
    assert not c.parent_used and c.size == build(src, tmp_path / "fresh.img").size
    d = build(src, tmp_path / "d.img", parent=b, max_dead=1.0)
    assert d.parent_used


def test_bad_parents_are_refused(tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_tree(src, {"f": os.urandom(10_000), "g": b"g"})
    a = build(src, tmp_path / "a.img")
    other = build(src, tmp_path / "other.img", pack_tails=False)
    with pytest.raises(BadInput, match="chunk map"):
        build(src, tmp_path / "x.img", parent=(a.path, other.refs[:-1]))
    junk = tmp_path / "junk"
    junk.write_bytes(os.urandom(8192))
    with pytest.raises(BadInput, match="not an EROFS"):
        build(src, tmp_path / "x.img", parent=(junk, a.refs))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.img", "junk", "other.img", "src"]


def test_parent_slots_and_runs(tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_tree(src, {"d/f": os.urandom(9000), "d/g": b"small", "h": os.urandom(5000)})
    a = build(src, tmp_path / "a.img", pack_tails=False)
    p = read_parent(a.path, a.refs)
    assert set(p.meta.slots) == {b"", b"d", b"d/f", b"d/g", b"h"}
    assert p.meta.slots[b""].pos == 0 and p.meta.slots[b""].room == 4096  # the root has its block
    assert p.blocks_of(b"d/f") is not None and len(p.blocks_of(b"d/f") or []) == 3
    assert p.blocks_of(b"d/g") is None  # inline
    assert p.dead_data == 0
    assert [c.offset for c in p.data_cuts][0] == 4096


def test_chunk_bits() -> None:
    assert chunk_bits([7]) == 0
    assert chunk_bits(list(range(10, 18))) == 3  # all contiguous: one chunk covers the file
    assert chunk_bits([*range(100, 104), *range(5, 9)]) == 2  # a break at 4
    assert chunk_bits([*range(100, 106), *range(5, 9)]) == 1  # a break at 6
    assert chunk_bits([1, 5, 6, 7]) == 0


def test_cli_parent_by_file_and_by_digest(tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_tree(src, {f"f{i}": os.urandom(3000 + i * 500) for i in range(40)})
    store = str(tmp_path / "store")
    assert layerctl("store", "init", "--store", store).code == 0
    r = layerctl("build", str(src), "-o", str(tmp_path / "a.img"), "--push", "--store", store, "--mtime", "5", "--json")
    assert r.code == 0, r.err
    first = r.json()
    (src / "f3").write_bytes(b"changed")
    r = layerctl("build", str(src), "-o", str(tmp_path / "b.img"), "--push", "--store", store, "--mtime", "5",
                 "--json", "--parent", str(tmp_path / "a.img"))
    assert r.code == 0, r.err
    second = r.json()
    assert second["parent_used"] and second["new_bytes"] < first["new_bytes"] // 4
    r = layerctl("build", str(src), "-o", str(tmp_path / "c.img"), "--store", store, "--mtime", "5", "--json",
                 "--parent", first["blob"])
    assert r.code == 0, r.err
    assert r.json()["blob"] == second["blob"] and r.json()["new_bytes"] is None  # not pushed
    assert (tmp_path / "c.img").read_bytes() == (tmp_path / "b.img").read_bytes()
    shutil.copy(tmp_path / "a.img", tmp_path / "copy.img")
    with open(tmp_path / "copy.img", "r+b") as f:  # flip a data byte (writing a fixed one may change nothing)
        f.seek(4096)
        byte = f.read(1)[0]
        f.seek(4096)
        f.write(bytes([byte ^ 0xFF]))
    r = layerctl("build", str(src), "--store", store, "--parent", str(tmp_path / "copy.img"))
    assert r.code != 0 and "not in store" in r.err
