"""Reading a tree a hostile owner may change while it is read (a running sandbox's upper being
committed): `untrusted_entries` with the safe opening of `layerstore.linux`, and that opening
itself (`read_regular_beneath`).

The races are made deterministic: a hook on `os.lstat` swaps a path right after the walk has
looked at it, the moment a kernel race would hit. Each of these holes was open in `dir_entries`
(the walker commit used before): a directory swapped for a symlink to a host directory after its
lstat put the host's files into the layer; a file swapped for a FIFO hung the walk in open(2); a
file swapped for /dev/zero (or a disk) had the device's bytes read into the layer; a large file's
parent swapped for a symlink before its content was read had the host file read."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from testkit import deadline
from testkit.hostile import SECRET, host_dir

from erofs_builder.sources.source_dir import dir_entries, untrusted_entries
from erofs_builder.tree import Kind
from layerstore.errors import BadInput, NotFound
from layerstore.linux import read_regular_beneath

DEADLINE = 20.0  # seconds: a walk that has not ended by then hangs


def walk(root: Path) -> Iterator[tuple[object, object]]:
    """The walker under test (the one a commit reads an upper with)."""
    return untrusted_entries(root)


def contents(entries: Iterator[tuple[object, object]]) -> dict[bytes, tuple[Kind, bytes | None]]:
    """path -> (kind, content), consuming each file's content as the image writer does: before
    the next entry is asked for."""
    out: dict[bytes, tuple[Kind, bytes | None]] = {}
    for entry, data in entries:
        body = None
        if data is not None:
            body = b"".join(bytes(x) if isinstance(x, bytes | memoryview) else b"\0" * x.length for x in data)
        out[entry.path] = (entry.kind, body)  # type: ignore[attr-defined]
    return out


def bounded(fn: Callable[[], object], unblock: Callable[[], None]) -> object:
    return deadline.bounded(fn, unblock, DEADLINE, "the walk")


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """A host directory the sandbox must never get into its layer: f and big hold SECRET."""
    return host_dir(tmp_path)


@pytest.fixture
def upper(tmp_path: Path) -> Path:
    u = tmp_path / "upper"
    (u / "d").mkdir(parents=True)
    (u / "d" / "f").write_bytes(b"sandbox data\n")
    (u / "top").write_bytes(b"sandbox file\n")
    return u


@contextlib.contextmanager
def after_lstat(monkeypatch: pytest.MonkeyPatch, name: bytes, swap: Callable[[], None]) -> Iterator[None]:
    """Call `swap` once, right after the walk's lstat of an entry called `name` returned."""
    real = os.lstat
    done = []

    def lstat(path: object, *a: object, **kw: object) -> os.stat_result:
        st = real(path, *a, **kw)  # type: ignore[arg-type]
        if not done and os.fsencode(path) == name:  # type: ignore[arg-type]
            done.append(True)
            swap()
        return st

    monkeypatch.setattr(os, "lstat", lstat)
    yield
    monkeypatch.setattr(os, "lstat", real)
    assert done, f"the walk never looked at {name!r}"


def assert_no_host_content(found: dict[bytes, tuple[Kind, bytes | None]]) -> None:
    for path, (_kind, body) in found.items():
        assert body is None or SECRET not in body, f"host content in {path!r}"


# -- a tree that holds still: the same entries as dir_entries -------------------------------------
def test_a_still_tree_gives_what_dir_entries_gives(tmp_path: Path, host: Path) -> None:
    u = tmp_path / "u"
    (u / "a" / "b").mkdir(parents=True)
    (u / "a" / "f").write_bytes(b"x" * 10)
    (u / "big").write_bytes(os.urandom(1 << 20))
    with open(u / "sparse", "wb") as f:
        f.seek(5 << 20)
        f.write(b"end")
    os.link(u / "a" / "f", u / "a" / "b" / "hard")
    os.symlink(host, u / "a" / "to-host")  # a symlink is data: recorded, never followed
    os.mkfifo(u / "fifo")
    (u / "e").mkdir()
    os.setxattr(u / "a", "user.k", b"v")
    want = [(repr(e), contents(iter([(e, d)]))) for e, d in dir_entries(u)]
    got = [(repr(e), contents(iter([(e, d)]))) for e, d in walk(u)]
    assert got == want
    found = contents(walk(u))
    assert found[b"a/to-host"][0] is Kind.SYMLINK and found[b"fifo"] == (Kind.FIFO, None)
    assert_no_host_content(found)


@pytest.mark.root
def test_whiteouts_are_kept_and_other_device_nodes_refused(upper: Path) -> None:
    os.mknod(upper / "gone", stat.S_IFCHR | 0o600, os.makedev(0, 0))
    assert contents(walk(upper))[b"gone"] == (Kind.CHR, None)
    os.mknod(upper / "zero", stat.S_IFCHR | 0o600, os.makedev(1, 5))
    with pytest.raises(BadInput, match="zero: a device node"):
        contents(walk(upper))
    os.unlink(upper / "zero")
    os.mknod(upper / "disk", stat.S_IFBLK | 0o600, os.makedev(7, 0))
    with pytest.raises(BadInput, match="disk: a device node"):
        contents(walk(upper))


# -- swapped between the walk's lstat and its open ------------------------------------------------
def test_a_directory_swapped_for_a_symlink_to_the_host(monkeypatch: pytest.MonkeyPatch, upper: Path,
                                                     host: Path) -> None:
    def swap() -> None:
        os.rename(upper / "d", upper / "d.away")
        os.symlink(host, upper / "d")

    found: dict[bytes, tuple[Kind, bytes | None]] = {}
    with after_lstat(monkeypatch, b"d", swap), pytest.raises(BadInput, match="d: changed while the tree was read"):
        for entry, data in walk(upper):
            found.update(contents(iter([(entry, data)])))
    assert_no_host_content(found)


def test_a_file_swapped_for_a_fifo_neither_hangs_nor_is_opened(monkeypatch: pytest.MonkeyPatch,
                                                                upper: Path) -> None:
    fifo = upper / "top"

    def swap() -> None:
        os.unlink(fifo)
        os.mkfifo(fifo)

    def unblock() -> None:  # a reader blocked in open(2) of the FIFO gets a writer
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    with after_lstat(monkeypatch, b"top", swap), pytest.raises(BadInput, match="top: changed while the tree was read"):
        bounded(lambda: contents(walk(upper)), unblock)


@pytest.mark.root
def test_a_file_swapped_for_a_device_node_is_not_read(monkeypatch: pytest.MonkeyPatch, upper: Path) -> None:
    def swap() -> None:  # /dev/zero's numbers: a disk's would read the host's disk
        os.unlink(upper / "top")
        os.mknod(upper / "top", stat.S_IFCHR | 0o600, os.makedev(1, 5))

    found: dict[bytes, tuple[Kind, bytes | None]] = {}
    with after_lstat(monkeypatch, b"top", swap), pytest.raises(BadInput, match="top: changed while the tree was read"):
        for entry, data in walk(upper):
            found.update(contents(iter([(entry, data)])))
    assert b"top" not in found  # neither zeros nor anything else read for it


def test_a_file_swapped_for_a_symlink_to_a_host_file(monkeypatch: pytest.MonkeyPatch, upper: Path,
                                                      host: Path) -> None:
    def swap() -> None:
        os.unlink(upper / "top")
        os.symlink(host / "f", upper / "top")

    with after_lstat(monkeypatch, b"top", swap), pytest.raises(BadInput, match="top: changed while the tree was read"):
        contents(walk(upper))


def test_a_file_replaced_by_another_file_is_refused(monkeypatch: pytest.MonkeyPatch, upper: Path) -> None:
    def swap() -> None:  # a new inode at the path: the walk's lstat no longer describes it
        (upper / "new").write_bytes(b"another file, of another size\n")
        os.rename(upper / "new", upper / "top")

    with after_lstat(monkeypatch, b"top", swap), pytest.raises(BadInput, match="another inode|changed while"):
        contents(walk(upper))


def test_a_large_files_parent_swapped_before_its_content_is_read(upper: Path, host: Path) -> None:
    (upper / "d" / "big").write_bytes(b"s" * (1 << 20))  # large: its content is read when consumed
    entries = walk(upper)
    found: dict[bytes, tuple[Kind, bytes | None]] = {}
    with pytest.raises(BadInput, match="d/big: changed while the tree was read"):
        for entry, data in entries:
            if entry.path == b"d/big":  # type: ignore[attr-defined]
                os.rename(upper / "d", upper / "d.away")
                os.symlink(host, upper / "d")
            found.update(contents(iter([(entry, data)])))
    assert_no_host_content(found)


def test_the_walk_closes_every_descriptor_it_opened(upper: Path) -> None:
    (upper / "d" / "e" / "f").mkdir(parents=True)
    before = set(os.listdir("/proc/self/fd"))
    entries = walk(upper)
    next(entries), next(entries), next(entries)  # deep inside
    entries.close()  # abandoned half-way (a failed build)
    contents(walk(upper))
    assert set(os.listdir("/proc/self/fd")) == before


# -- the safe opening itself ----------------------------------------------------------------------
def test_read_regular_beneath(tmp_path: Path, host: Path) -> None:
    r = tmp_path / "root"
    (r / "etc").mkdir(parents=True)
    (r / "etc" / "passwd").write_bytes(b"root:x:0:0::/root:/bin/sh\n")
    assert read_regular_beneath(r, "/etc/passwd", 4096) == b"root:x:0:0::/root:/bin/sh\n"
    fd = os.open(r, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert read_regular_beneath(fd, "etc/passwd", 4096).startswith(b"root:")
    finally:
        os.close(fd)
    os.symlink(host, r / "hostdir")
    os.symlink(host / "f", r / "etc" / "group")
    os.mkfifo(r / "etc" / "fifo")
    cases = {"hostdir/f": "a symlink on the path", "etc/group": "a symlink where a regular file",
             "etc/fifo": "a FIFO where a regular file", "../host/f": "leaves its directory",
             "etc": "a directory where a regular file"}
    for rel, why in cases.items():
        with pytest.raises(BadInput, match=why):
            bounded(lambda rel=rel: read_regular_beneath(r, rel, 4096), lambda: None)
    with pytest.raises(BadInput, match="larger than 4 bytes"):
        read_regular_beneath(r, "etc/passwd", 4)
    with pytest.raises(NotFound):
        read_regular_beneath(r, "etc/shadow", 4096)


@pytest.mark.root
def test_read_regular_beneath_never_opens_a_device(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    os.mknod(tmp_path / "etc" / "passwd", stat.S_IFCHR | 0o600, os.makedev(1, 5))
    with pytest.raises(BadInput, match="a character device where a regular file"):
        read_regular_beneath(tmp_path, "etc/passwd", 4096)


def test_a_node_removed_after_the_walks_lstat_is_a_clear_refusal(monkeypatch: pytest.MonkeyPatch,
                                                                  upper: Path) -> None:
    os.mkfifo(upper / "pipe")
    with after_lstat(monkeypatch, b"pipe", lambda: os.unlink(upper / "pipe")), \
            pytest.raises(BadInput, match="pipe: changed while the tree was read"):
        contents(walk(upper))
