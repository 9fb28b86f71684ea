"""Property test: any tree of entries builds into an image that fsck.erofs accepts, the kernel
mounts and shows exactly as described, and that rebuilds byte for byte."""

from __future__ import annotations

import dataclasses
import random
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from testkit.erofs_helpers import (
    HAVE_FSCK,
    assert_trees_equal,
    expected_snapshot,
    fsck_erofs,
    mounted_erofs,
    snapshot_tree,
)

from erofs_builder.build import build_layer
from erofs_builder.tree import Entry, Hole, Kind

pytestmark = [pytest.mark.root, pytest.mark.skipif(not HAVE_FSCK, reason="needs fsck.erofs")]

_ascii = st.text(alphabet="abcdefXYZ0123._-+ ", min_size=1, max_size=16).map(str.encode)
_odd = st.binary(min_size=1, max_size=255).filter(lambda b: b"/" not in b and b"\0" not in b)
names = st.one_of(_ascii, _ascii, _odd, st.integers(200, 255).map(lambda n: b"L" * n)).filter(
    lambda b: b not in (b".", b".."))
XATTR_NAMES = [b"user.a", b"user.long." + b"n" * 100, b"trusted.overlay.opaque", b"security.test", b"trusted.x"]
XATTR_VALUES = [b"", b"y", b"shared-value", b"v" * 200, bytes(range(256)) * 4]
owners = st.sampled_from([0, 1, 1000, 65535, 65536, 1 << 31])
mtimes = st.tuples(st.sampled_from([0, 1, 1_000_000_000, 1_700_000_000, (1 << 32) + 5]),
                   st.sampled_from([0, 0, 1, 999_999_999]))


@st.composite
def contents(draw: Any) -> tuple[list[bytes | Hole], bytes]:
    """A file's pieces as the writer receives them, and the bytes they stand for."""
    pieces: list[bytes | Hole] = []
    whole = bytearray()
    rng = random.Random(draw(st.integers(0, 1 << 30)))
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["small", "small", "block", "big", "hole", "bighole"]))
        n = {"small": draw(st.integers(1, 5000)), "block": 4096 * draw(st.integers(1, 3)),
             "big": draw(st.integers(300_000, 2_500_000)), "hole": draw(st.integers(1, 9000)),
             "bighole": draw(st.integers(1 << 20, 8 << 20))}[kind]
        if "hole" in kind:
            pieces.append(Hole(n))
            whole += bytes(n)
        else:
            data = rng.randbytes(n)
            pieces.append(data)
            whole += data
    return pieces, bytes(whole)


@st.composite
def trees(draw: Any) -> list[tuple[Entry, list[bytes | Hole] | None, bytes | None]]:
    out: list[tuple[Entry, list[bytes | Hole] | None, bytes | None]] = []
    dirs = [b""]
    nondirs: list[bytes] = []
    used: set[bytes] = {b""}
    for _ in range(draw(st.integers(1, 25))):
        parent = draw(st.sampled_from(dirs))
        path = parent + b"/" + draw(names) if parent else draw(names)
        if path in used or len(path) > 3000:
            continue
        used.add(path)
        if nondirs and draw(st.integers(0, 9)) == 0:
            out.append((Entry(path, Kind.REG, hardlink=draw(st.sampled_from(nondirs))), None, None))
            continue
        kind = draw(st.sampled_from([Kind.REG, Kind.REG, Kind.REG, Kind.DIR, Kind.DIR, Kind.SYMLINK, Kind.CHR,
                                     Kind.BLK, Kind.FIFO, Kind.SOCK]))
        mtime, nsec = draw(mtimes)
        xattrs = {k: draw(st.sampled_from(XATTR_VALUES))
                  for k in draw(st.lists(st.sampled_from(XATTR_NAMES), max_size=3, unique=True))
                  # the VFS hides user.* on anything but files and directories
                  if kind in (Kind.REG, Kind.DIR) or not k.startswith(b"user.")}
        e = Entry(path, kind, mode=draw(st.integers(0, 0o7777)), uid=draw(owners), gid=draw(owners),
                  mtime=mtime, mtime_nsec=nsec, xattrs=xattrs)
        pieces: list[bytes | Hole] | None = None
        content: bytes | None = None
        if kind is Kind.REG:
            pieces, content = draw(contents())
            e.size = len(content)
        elif kind is Kind.SYMLINK:
            e.symlink = draw(st.binary(min_size=1, max_size=300).filter(lambda b: b"\0" not in b))
        elif kind in (Kind.CHR, Kind.BLK):
            e.rdev = (draw(st.integers(0, 4095)), draw(st.integers(0, (1 << 20) - 1)))
        if kind is Kind.DIR:
            dirs.append(path)
        else:
            nondirs.append(path)
        out.append((e, pieces, content))
    if draw(st.booleans()):  # tar streams may name a directory after its children
        out = [t for t in out if t[0].kind is not Kind.DIR] + [t for t in out if t[0].kind is Kind.DIR]
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(tree=trees(), clamp=st.sampled_from([None, None, 1_000_000_000]))
def test_any_tree_round_trips_through_the_kernel(tree: list[tuple[Entry, Any, Any]], clamp: int | None) -> None:
    with tempfile.TemporaryDirectory(prefix="erofs-hyp-") as tmp:
        a = build_layer([(e, p) for e, p, _c in tree], Path(tmp) / "a.img", mtime_clamp=clamp)
        fsck_erofs(a.path)
        with mounted_erofs(a.path) as mnt:
            got = snapshot_tree(mnt)
        want = expected_snapshot([(e, c) for e, _p, c in tree], mtime_clamp=clamp)
        assert_trees_equal(want, got)
        b = build_layer([(e, list(p) if p is not None else None) for e, p, _c in tree], Path(tmp) / "b.img",
                        mtime_clamp=clamp)
        assert (a.blob, a.refs) == (b.blob, b.refs)


@st.composite
def releases(draw: Any) -> tuple[list[tuple[Entry, Any, Any]], list[tuple[Entry, Any, Any]]]:
    """A tree and a next release of it: entries dropped, files edited (often keeping a prefix),
    metadata changed, and a few new entries."""
    first = draw(trees())
    second: list[tuple[Entry, Any, Any]] = []
    kept: set[bytes] = set()
    for e, pieces, content in first:
        if draw(st.integers(0, 5)) == 0 or (e.hardlink is not None and e.hardlink not in kept):
            continue
        what = draw(st.sampled_from(["same", "same", "same", "edit", "meta"]))
        if what == "edit" and e.kind is Kind.REG and e.hardlink is None:
            _p, extra = draw(contents())
            content = content[:draw(st.integers(0, len(content)))] + extra
            pieces = [content[i:i + 70_000] for i in range(0, len(content), 70_000)]
            e = dataclasses.replace(e, size=len(content))
        elif what == "meta" and e.hardlink is None:
            e = dataclasses.replace(e, mode=draw(st.integers(0, 0o7777)), uid=draw(owners))
        kept.add(e.path)
        second.append((e, pieces, content))
    for e, pieces, content in draw(trees()):
        moved = dataclasses.replace(e, path=b"new/" + e.path,
                                    hardlink=None if e.hardlink is None else b"new/" + e.hardlink)
        second.append((moved, pieces, content))
    return first, second


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(pair=releases())
def test_a_release_built_on_its_parent_round_trips(pair: tuple[list[Any], list[Any]]) -> None:
    first, second = pair
    with tempfile.TemporaryDirectory(prefix="erofs-hyp-") as tmp:
        a = build_layer([(e, p) for e, p, _c in first], Path(tmp) / "a.img")
        b = build_layer([(e, p) for e, p, _c in second], Path(tmp) / "b.img", parent=a)
        assert b.parent_used
        fsck_erofs(b.path)
        with mounted_erofs(b.path) as mnt:
            got = snapshot_tree(mnt)
        assert_trees_equal(expected_snapshot([(e, c) for e, _p, c in second]), got)
        again = build_layer([(e, p) for e, p, _c in second], Path(tmp) / "again.img", parent=a)
        assert (again.blob, again.refs) == (b.blob, b.refs)
