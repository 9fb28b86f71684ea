"""Tar streams as layer entries: the reader's units, then real archives (Python's tarfile and GNU
tar, every format, plain/gzip/zstd) built into EROFS, mounted and compared with their source."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from testkit import archive_factory as af
from testkit.erofs_helpers import assert_trees_equal, mounted_erofs, snapshot_tree

from erofs_builder.build import build_layer
from erofs_builder.sources.source_tar import tar_entries
from erofs_builder.tree import Entry, Hole, Kind
from layerstore.errors import BadInput


def read_all(data: bytes, name: str = "test.tar") -> list[tuple[Entry, bytes | None]]:
    out = []
    for entry, content in tar_entries(io.BytesIO(data), name=name):
        if content is None:
            out.append((entry, None))
            continue
        buf = bytearray()
        for block in content:
            buf += bytes(block.length) if isinstance(block, Hole) else bytes(block)
        out.append((entry, bytes(buf)))
    return out


def by_path(data: bytes) -> dict[bytes, tuple[Entry, bytes | None]]:
    return {e.path: (e, c) for e, c in read_all(data)}


# -- units ------------------------------------------------------------------------------------
def test_normalises_dot_slash_and_absolute_paths() -> None:
    data = af.raw_tar(af.member("./a/./b//c", b"x"), af.member("/abs/file", b"y"), af.header("./", typeflag=b"5"),
                      af.header("d/", typeflag=b"5"))
    paths = [e.path for e, _ in read_all(data)]
    assert paths == [b"a/b/c", b"abs/file", b"", b"d"]


def test_member_types_and_metadata() -> None:
    data = af.raw_tar(
        af.member("f", b"hello", mode=0o4755, uid=1000, gid=2000, mtime=12345),
        af.header("l", typeflag=b"2", linkname="f"),
        af.header("h", typeflag=b"1", linkname="f"),
        af.header("h2", typeflag=b"1", linkname="h"),  # a link to a link points at the original
        af.header("c", typeflag=b"3", devmajor=1, devminor=3, mode=0o666),
        af.header("b", typeflag=b"4", devmajor=259, devminor=70000),
        af.header("p", typeflag=b"6"),
        af.header("d", typeflag=b"5", mode=0o1777),
        af.member("old-dir/", typeflag=b"\0"),  # v7: a trailing slash marks a directory
    )
    got = by_path(data)
    f, content = got[b"f"]
    assert (f.kind, f.mode, f.uid, f.gid, f.mtime, f.size, content) == (Kind.REG, 0o4755, 1000, 2000, 12345, 5,
                                                                         b"hello")
    assert got[b"l"][0].symlink == b"f" and got[b"l"][0].kind is Kind.SYMLINK
    assert got[b"h"][0].hardlink == b"f" and got[b"h2"][0].hardlink == b"f"
    assert got[b"h"][1] is None
    assert got[b"c"][0].rdev == (1, 3) and got[b"c"][0].kind is Kind.CHR
    assert got[b"b"][0].rdev == (259, 70000) and got[b"b"][0].kind is Kind.BLK
    assert got[b"p"][0].kind is Kind.FIFO
    assert got[b"d"][0].kind is Kind.DIR and got[b"d"][0].mode == 0o1777
    assert got[b"old-dir"][0].kind is Kind.DIR


def test_pax_overrides_and_xattrs() -> None:
    data = af.raw_tar(
        af.pax({"path": "a/" + "p" * 200, "mtime": "1700000000.123456789", "uid": "4294967295", "gid": "70000",
                "SCHILY.xattr.user.bin": b"\x00\xff", "LIBARCHIVE.xattr.user.lib%20name": "aGVsbG8",
                "RHT.security.selinux": "system_u:object_r:bin_t:s0"}),
        af.member("short", b"abc"),
        af.pax({"mtime": "-1.5", "size": "3"}), af.member("neg", b"xyz", size_field=af._octal(0, 12)),
        af.pax({"linkpath": "t" * 300}), af.header("longlink", typeflag=b"2", linkname="x"),
    )
    got = by_path(data)
    e, content = got[b"a/" + b"p" * 200]
    assert content == b"abc"
    assert (e.mtime, e.mtime_nsec, e.uid, e.gid) == (1700000000, 123456789, 2**32 - 1, 70000)
    assert e.xattrs == {b"user.bin": b"\x00\xff", b"user.lib name": b"hello",
                        b"security.selinux": b"system_u:object_r:bin_t:s0"}
    neg, content = got[b"neg"]
    assert (neg.mtime, neg.mtime_nsec, content) == (0, 0, b"xyz")  # pre-1970 clamps; pax size wins
    assert got[b"longlink"][0].symlink == b"t" * 300


def test_global_pax_header_as_git_archive_writes() -> None:
    data = af.raw_tar(af.pax({"comment": "0123abcd", "mtime": "42"}, typeflag=b"g"), af.member("f", b"1"),
                      af.member("g", b"2"))
    assert [(e.path, e.mtime) for e, _ in read_all(data)] == [(b"f", 42), (b"g", 42)]


def test_gnu_long_names() -> None:
    long = "x/" + "y" * 250
    data = af.raw_tar(af.member("././@LongLink", long.encode() + b"\0", typeflag=b"L"), af.member("trunc", b"d"),
                      af.member("././@LongLink", b"z" * 200 + b"\0", typeflag=b"K"),
                      af.header("s", typeflag=b"2", linkname="zz"))
    got = by_path(data)
    assert got[long.encode()][1] == b"d"
    assert got[b"s"][0].symlink == b"z" * 200


def test_unconsumed_data_is_skipped_and_cannot_be_read_later() -> None:
    data = af.raw_tar(af.member("a", b"A" * 3000), af.member("b", b"B" * 10))
    it = tar_entries(io.BytesIO(data), name="t")
    a, a_data = next(it)
    b, b_data = next(it)
    assert b"".join(b_data) == b"B" * 10  # type: ignore[arg-type]
    with pytest.raises(BadInput, match="after the archive moved on"):
        list(a_data)  # type: ignore[arg-type]
    assert list(it) == []


@pytest.mark.parametrize("codec", ["gzip", "zstd", "xz", "bzip2"])
def test_compression_is_detected(codec: str) -> None:
    import bz2
    import lzma

    raw = af.raw_tar(af.member("f", os.urandom(5000)))
    comp = {"gzip": lambda d: af.compress(d, "gzip"), "zstd": lambda d: af.compress(d, "zstd"),
            "xz": lzma.compress, "bzip2": bz2.compress}[codec](raw)
    assert read_all(comp) == read_all(raw)


def test_zstd_multiple_frames_and_gzip_members() -> None:
    raw = af.raw_tar(af.member("f", os.urandom(5000)), af.member("g", b"x" * 100_000))
    cut = 1536
    z = zstandard.ZstdCompressor()
    assert read_all(z.compress(raw[:cut]) + z.compress(raw[cut:])) == read_all(raw)
    assert read_all(af.compress(raw[:cut], "gzip") + af.compress(raw[cut:], "gzip")) == read_all(raw)


def test_gnu_tar_sparse_files(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "sparse", "wb") as f:
        f.truncate(64 << 20)
        for off in (0, 5 << 20, (64 << 20) - 1):
            f.seek(off)
            f.write(b"!")
    want = (src / "sparse").read_bytes()
    for fmt in ("gnu", "oldgnu", "posix"):
        tar = af.tar_with_gnu_tar(src, tmp_path / f"{fmt}.tar", fmt)
        assert tar.stat().st_size < 1 << 20  # stored sparse
        with open(tar, "rb") as f:
            for entry, content in tar_entries(f, name=fmt):
                if entry.path == b"sparse":
                    blocks = list(content)  # type: ignore[arg-type]
                    assert entry.size == 64 << 20
                    assert sum(b.length for b in blocks if isinstance(b, Hole)) > 60 << 20
                    data = b"".join(bytes(b.length) if isinstance(b, Hole) else bytes(b) for b in blocks)
                    assert data == want


# -- real archives, built and mounted ---------------------------------------------------------
def _build_and_compare(tmp_path: Path, src: Path, archive: bytes, name: str) -> None:
    image = tmp_path / f"{name}.erofs"
    layer = build_layer(tar_entries(io.BytesIO(archive), name=name), image)
    assert layer.path == image and image.stat().st_size == layer.size
    want = snapshot_tree(src)
    with mounted_erofs(image) as mnt:
        assert_trees_equal(want, snapshot_tree(mnt))


@pytest.fixture(scope="module")
def full_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return af.make_tree(tmp_path_factory.mktemp("src") / "tree")


@pytest.fixture(scope="module")
def plain_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What every format can hold: no xattrs, no names past 100 bytes."""
    root = tmp_path_factory.mktemp("plain") / "tree"
    af.make_tree(root, xattrs=False, odd_names=False, long_names=False)
    return root


@pytest.mark.root
@pytest.mark.parametrize("fmt,codec", [("pax", "none"), ("pax", "gzip"), ("pax", "zstd"), ("gnu", "none"),
                                       ("gnu", "zstd")])
def test_python_tarfile_archives(tmp_path: Path, full_tree: Path, fmt: str, codec: str) -> None:
    tar_format = {"pax": tarfile.PAX_FORMAT, "gnu": tarfile.GNU_FORMAT}[fmt]
    src = full_tree if fmt == "pax" else _without_xattrs(full_tree, tmp_path)
    _build_and_compare(tmp_path, src, af.compress(af.tar_with_tarfile(src, tar_format), codec), f"py-{fmt}")


@pytest.mark.root
def test_python_tarfile_ustar(tmp_path: Path, plain_tree: Path) -> None:
    _build_and_compare(tmp_path, plain_tree, af.tar_with_tarfile(plain_tree, tarfile.USTAR_FORMAT), "py-ustar")


@pytest.mark.root
@pytest.mark.parametrize("fmt,codec", [("posix", "none"), ("posix", "gzip"), ("gnu", "zstd"), ("oldgnu", "none")])
def test_gnu_tar_archives(tmp_path: Path, full_tree: Path, fmt: str, codec: str) -> None:
    src = full_tree if fmt == "posix" else _without_xattrs(full_tree, tmp_path)
    tar = af.tar_with_gnu_tar(src, tmp_path / "a.tar", fmt)
    _build_and_compare(tmp_path, src, af.compress(tar.read_bytes(), codec), f"gnu-{fmt}")


@pytest.mark.root
@pytest.mark.parametrize("fmt", ["ustar", "v7"])
def test_gnu_tar_old_formats(tmp_path: Path, plain_tree: Path, fmt: str) -> None:
    src = plain_tree
    if fmt == "v7":  # v7 holds no devices or fifos, and no owner above 2097151
        src = tmp_path / "v7src"
        subprocess.run(["cp", "-a", str(plain_tree), str(src)], check=True)
        for name in ("fifo", "null", "loop9"):
            (src / name).unlink()
        af.set_mtimes(src)
    tar = af.tar_with_gnu_tar(src, tmp_path / "a.tar", fmt)
    _build_and_compare(tmp_path, src, tar.read_bytes(), f"gnu-{fmt}")


def _without_xattrs(tree: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "noxattr"
    subprocess.run(["cp", "-a", "--no-preserve=xattr", str(tree), str(copy)], check=True)
    for dirpath, dirnames, filenames in os.walk(copy):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            for x in os.listxattr(p, follow_symlinks=False):
                os.removexattr(p, x, follow_symlinks=False)
    for x in os.listxattr(copy):
        os.removexattr(copy, x)
    af.set_mtimes(copy)
    return copy


# -- properties -------------------------------------------------------------------------------
_names = st.text(alphabet="abc.-_é ", min_size=1, max_size=12).filter(lambda s: s not in (".", ".."))
_members = st.dictionaries(
    st.lists(_names, min_size=1, max_size=3).map("/".join),
    st.one_of(st.binary(max_size=2000), st.tuples(st.just("symlink"), _names)),
    max_size=12,
)


def _tar_of(members: dict[str, object], fmt: int) -> tuple[bytes, dict[bytes, object]]:
    """Members as files and symlinks (parents as directories); skips paths under a file."""
    buf, want = io.BytesIO(), {}
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        taken: set[str] = set()
        for path, value in members.items():
            parts = path.split("/")
            if any("/".join(parts[:i]) in taken for i in range(1, len(parts) + 1)):
                continue
            if any(p.startswith(path + "/") for p in taken):
                continue
            taken.add(path)
            info = tarfile.TarInfo("./" + path)
            if isinstance(value, bytes):
                info.size = len(value)
                tf.addfile(info, io.BytesIO(value))
            else:
                info.type, info.linkname = tarfile.SYMTYPE, value[1]  # type: ignore[index]
                tf.addfile(info)
            want[path.encode()] = value if isinstance(value, bytes) else value[1].encode()  # type: ignore[index]
    return buf.getvalue(), want


@settings(max_examples=60, deadline=None)
@given(_members, st.sampled_from([tarfile.PAX_FORMAT, tarfile.GNU_FORMAT]))
def test_reads_back_what_tarfile_wrote(members: dict[str, object], fmt: int) -> None:
    data, want = _tar_of(members, fmt)
    got = {e.path: (c if e.kind is Kind.REG else e.symlink) for e, c in read_all(data)}
    assert got == want


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=6),
       st.integers(0, 10**6), st.sampled_from(["none", "gzip", "zstd"]))
def test_damaged_archives_fail_only_with_bad_input(flips: list[tuple[int, int]], cut: int, codec: str) -> None:
    """Whatever the damage, the reader either reads the archive or raises BadInput."""
    data = bytearray(af.compress(_FUZZ_BASE, codec))
    for pos, value in flips:
        data[pos % len(data)] = value
    data = data[:len(data) - cut % 700] if cut % 3 == 0 else data
    with contextlib.suppress(BadInput):
        read_all(bytes(data))


def test_fuzz_base_is_valid() -> None:
    got = by_path(_FUZZ_BASE)
    assert got[b"sp"][1] == bytes(100) + b"abc" + bytes(4897)
    assert got[b"long/" + b"y" * 120][1] == b"z" * 700 and got[b"h"][0].hardlink == b"plain"


_FUZZ_BASE = af.raw_tar(
    af.pax({"path": "p/" + "x" * 150, "mtime": "1.5", "SCHILY.xattr.user.a": "b"}), af.member("short", b"data" * 40),
    af.member("././@LongLink", b"long/" + b"y" * 120 + b"\0", typeflag=b"L"), af.member("t", b"z" * 700),
    af.header("l", typeflag=b"2", linkname="t"), af.member("plain", b"p"),
    af.header("h", typeflag=b"1", linkname="plain"),
    af.pax({"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": "sp",
            "GNU.sparse.realsize": "5000"}),
    af.member("GNUSparseFile/sp", b"1\n100\n3\n".ljust(512, b"\0") + b"abc"),
)
