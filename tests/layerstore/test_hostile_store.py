"""A hostile store: whoever can write it (another team, a tampered plain-HTTP S3 endpoint, a
client of a shared CephFS) puts wrong objects under the keys of a signed layer. Every case must
end in a clear `CorruptObject`: never the wrong bytes, never a hang, never a huge allocation.
Run against a local directory, CephFS through ceph-fuse and S3 on radosgw (the real single-node
Ceph the harness starts); the special-file cases only where a key is a path (POSIX backends).

Which of these the code before issue 12 let through (each test says it too): a forged or
swapped chunk map was served by every node (only `store get-blob` noticed, by the whole-file
hash), a symlink at a key was followed, a FIFO hung the reader (and `Store.close` after it), a
device node was opened and read (refused only because its size reads as 0), and an oversized
object was read whole into memory.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest
from testkit.fuse_helpers import DaemonThread, build_and_push, make_tree, read_errno

from layerstore import chunkmap, chunkobj, keys
from layerstore import digest as digestmod
from layerstore.backends.posix import PosixBackend
from layerstore.chunkmap import ChunkMap
from layerstore.errors import CorruptObject
from layerstore.store import MAX_OBJECT_SIZE, Store

BACKENDS = ["local", pytest.param("cephfs", marks=pytest.mark.ceph), pytest.param("s3", marks=pytest.mark.ceph)]
CHUNK = 64 * 1024
DEADLINE = 60.0  # seconds a refused load may take at most; a hang fails the test instead of blocking it


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "local":
        url = str(tmp_path / "store")
    elif request.param == "cephfs":
        url = request.getfixturevalue("cephfs_store_url")
    else:
        url = request.getfixturevalue("s3_store_url")
    with Store.open(url) as s:
        s.init()
        yield s


def _payload(n: int, seed: int) -> bytes:
    out = bytearray()
    block = digestmod.raw_of(digestmod.of(seed.to_bytes(8, "little")))
    while len(out) < n:
        block = digestmod.raw_of(digestmod.of(block))
        out += block
    return bytes(out[:n])


def _put(store: Store, tmp_path: Path, name: str, data: bytes) -> ChunkMap:
    path = tmp_path / name
    path.write_bytes(data)
    return store.get_chunk_map(store.put_blob(path, chunk_size=CHUNK).blob)


@pytest.fixture
def signed(store: Store, tmp_path: Path) -> tuple[ChunkMap, bytes]:
    """A layer the environment's signature names (its blob id), and its bytes."""
    data = _payload(3 * CHUNK + 100, 1)
    return _put(store, tmp_path, "signed", data), data


def _overwrite(store: Store, key: str, data: bytes) -> None:
    """Replace an object's bytes behind the store's back, as a hostile writer would."""
    store.backend.delete(key)
    assert store.backend.store_once(key, data)


def _refused(fn: Callable[[], Any], match: str = "") -> CorruptObject:
    """Run `fn` in a thread with a deadline: it must raise `CorruptObject` (matching `match`),
    not return bytes, not hang."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(DEADLINE)
    assert not t.is_alive(), f"the load hung (> {DEADLINE} s)"
    assert "value" not in out, f"returned {type(out['value'])} instead of refusing"
    err = out["error"]
    assert isinstance(err, CorruptObject), repr(err)
    assert match in str(err), str(err)
    return err


def _read_blob(store: Store, blob: str, tmp_path: Path) -> bytes:
    out = tmp_path / "out"
    with open(out, "wb") as f:
        store.read_blob(blob, f.fileno())
    return out.read_bytes()


def _map_key(cm: ChunkMap) -> str:
    return keys.object_key("blobs", cm.blob)


# -- chunk maps: the identity of a layer covers its chunk list ---------------------------------
def test_forged_map_is_refused(store: Store, signed: tuple[ChunkMap, bytes], tmp_path: Path) -> None:
    """A map with other (present, valid) chunks under a signed layer's blob key. Old code:
    `get_chunk_map` returned it (its own trailer checksum and blob field were forged too), so
    every node served the other bytes."""
    cm, data = signed
    other = _put(store, tmp_path, "other", _payload(len(data), 2))
    forged = ChunkMap(blob=cm.blob, size=other.size, chunks=other.chunks)
    _overwrite(store, _map_key(cm), forged.encode())
    _refused(lambda: store.get_chunk_map(cm.blob), f"chunk map does not belong to blob {cm.blob}")
    _refused(lambda: _read_blob(store, cm.blob, tmp_path), "does not belong")
    assert _map_key(cm) in store.verify().corrupt


def test_swapped_map_is_refused(store: Store, signed: tuple[ChunkMap, bytes], tmp_path: Path) -> None:
    """Another blob's valid map, byte for byte, under this blob's key. Old code: refused only by
    the blob field inside the map, which a forger rewrites along with the trailer (see above)."""
    cm, data = signed
    other = _put(store, tmp_path, "other", _payload(len(data) + 5000, 3))
    _overwrite(store, _map_key(cm), store.backend.load(_map_key(other)))
    _refused(lambda: store.get_chunk_map(cm.blob), "does not belong")


def test_format_1_map_says_to_rebuild(store: Store, signed: tuple[ChunkMap, bytes]) -> None:
    """A store written by an older layerstore: a clear error, never silent acceptance."""
    cm, _ = signed
    body = struct.pack("<4sB3xIQ32s", b"LSCM", 1, 0, 0, digestmod.raw_of(cm.blob))
    _overwrite(store, _map_key(cm), body + blake3.blake3(body).digest())
    _refused(lambda: store.get_chunk_map(cm.blob), "rebuild the layer and push it again")


# -- chunk objects --------------------------------------------------------------------------------
def test_truncated_chunk(store: Store, signed: tuple[ChunkMap, bytes], tmp_path: Path) -> None:
    cm, _ = signed
    ref = cm.chunks[1]
    key = store.chunk_key(ref.digest)
    _overwrite(store, key, store.backend.load(key)[: chunkobj.HEADER_SIZE + 10])
    _refused(lambda: store.get_chunk(ref.digest))
    _refused(lambda: _read_blob(store, cm.blob, tmp_path))


def test_chunk_that_hashes_wrong(store: Store, signed: tuple[ChunkMap, bytes], tmp_path: Path) -> None:
    """A well-formed object of other bytes (same length) under a chunk's key."""
    cm, _ = signed
    ref = cm.chunks[0]
    _overwrite(store, store.chunk_key(ref.digest), chunkobj.pack(_payload(ref.length, 9)))
    _refused(lambda: store.get_chunk(ref.digest), "hashes to")
    _refused(lambda: _read_blob(store, cm.blob, tmp_path), "hashes to")


@pytest.mark.parametrize("kind", ["chunks", "blobs", "manifests"])
def test_oversized_object(store: Store, signed: tuple[ChunkMap, bytes], kind: str,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    """An object larger than any of its kind can be is refused from its length, before it is
    read. Old code: read it whole into memory (then failed to decode it). The limits are
    lowered here so that S3 needs no huge upload; the real ones are checked below."""
    cm, _ = signed
    ident = {"chunks": cm.chunks[0].digest, "blobs": cm.blob, "manifests": store.put_manifest(b"{}")}[kind]
    limit = 200_000
    monkeypatch.setitem(MAX_OBJECT_SIZE, kind, limit)
    key = keys.object_key(kind, ident)
    _overwrite(store, key, b"\0" * (limit + 1))
    load = {"chunks": store.get_chunk, "blobs": store.get_chunk_map, "manifests": store.get_manifest}[kind]
    _refused(lambda: load(ident), "more than such an object can have")


def test_the_limits() -> None:
    """A chunk object: header + the largest chunk, compressed worst case; a chunk map: header +
    the most entries; a manifest object: its payload is at most manifest.schema's limit."""
    from layerstore.store import MAX_MANIFEST_BYTES as STORE_MAX_MANIFEST
    from manifest.schema import MAX_MANIFEST_BYTES

    assert MAX_MANIFEST_BYTES == STORE_MAX_MANIFEST
    assert MAX_OBJECT_SIZE["chunks"] == chunkobj.max_object_size(chunkobj.MAX_CHUNK) < chunkobj.MAX_CHUNK + (1 << 20)
    assert chunkobj.max_object_size(0) == chunkobj.HEADER_SIZE + 64  # zstd's bound for an empty input
    assert MAX_OBJECT_SIZE["blobs"] == 20 + chunkmap.MAX_ENTRIES * 48
    assert MAX_OBJECT_SIZE["manifests"] == chunkobj.max_object_size(MAX_MANIFEST_BYTES)


# -- special files at a key (POSIX backends: a key is a path) -----------------------------------
def _posix_path(store: Store, key: str) -> Path:
    if not isinstance(store.backend, PosixBackend):
        pytest.skip("a key is a path only on POSIX backends")
    return store.backend.root / key


def _place(path: Path, what: str, host: Path) -> None:
    path.unlink()
    if what == "symlink":
        path.symlink_to(host)
    elif what == "fifo":
        os.mkfifo(path)
    elif what == "device":
        if os.geteuid() != 0:
            pytest.skip("mknod needs root")
        try:
            os.mknod(path, 0o644 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero
        except PermissionError:
            pytest.skip("this filesystem refuses device nodes")
    else:  # sparse: 8 GiB where a small object belongs
        with open(path, "wb") as f:
            f.truncate(8 << 30)


@pytest.mark.parametrize("what", ["symlink", "fifo", "device", "sparse"])
@pytest.mark.parametrize("at", ["chunk", "map"])
def test_special_file_at_a_key(store: Store, signed: tuple[ChunkMap, bytes], tmp_path: Path, what: str,
                               at: str) -> None:
    """A symlink to a host file (holding the right bytes, even), a FIFO, /dev/zero, or an 8 GiB
    sparse file at a chunk key and at a map key: never followed, never read, never waited on.
    Old code: followed the symlink (and served the host file's bytes), hung on the FIFO, opened
    and read the device (refused by luck: its size reads as 0), allocated 8 GiB for the sparse
    file."""
    cm, data = signed
    ref = cm.chunks[1]
    key = store.chunk_key(ref.digest) if at == "chunk" else _map_key(cm)
    path = _posix_path(store, key)
    host = tmp_path / "host-file"
    host.write_bytes(path.read_bytes())  # the very bytes that belong at this key
    _place(path, what, host)
    load = (lambda: store.get_chunk(ref.digest)) if at == "chunk" else (lambda: store.get_chunk_map(cm.blob))
    err = _refused(load)
    if what != "sparse":
        assert "not an object" in str(err)
    _refused(lambda: _read_blob(store, cm.blob, tmp_path))
    assert store.backend.exists(key) is (what == "sparse")  # only a regular file is an object
    assert key in store.verify().corrupt


def test_a_fifo_does_not_hang_get_blob(store: Store, signed: tuple[ChunkMap, bytes], tmp_path: Path) -> None:
    """The same through the CLI's path (`store get-blob` = `read_blob` on worker threads)."""
    cm, _ = signed
    path = _posix_path(store, store.chunk_key(cm.chunks[2].digest))
    _place(path, "fifo", tmp_path)
    _refused(lambda: _read_blob(store, cm.blob, tmp_path), "FIFO")


# -- end to end: the node daemon refuses a forged map before any byte is served -----------------
@pytest.mark.root
def test_daemon_refuses_a_forged_map(tmp_path: Path) -> None:
    """A signed layer's map replaced by a map of another layer's (present, valid) chunks: the
    node daemon refuses the blob at lookup/open (ENOENT or EIO); no byte of it is served, and
    the layer's real content is not what a reader gets either. Old code: served the other
    layer's bytes under the signed layer's name."""
    with Store.open(str(tmp_path / "store")) as store:
        store.init()
        layer = build_and_push(store, make_tree(tmp_path / "a", seed=1), tmp_path / "a.img")
        other = build_and_push(store, make_tree(tmp_path / "b", seed=2), tmp_path / "b.img")
        forged = ChunkMap(blob=layer.blob, size=other.size, chunks=tuple(other.refs))
        _overwrite(store, keys.object_key("blobs", layer.blob), forged.encode())
        with DaemonThread(store, tmp_path / "cache", tmp_path / "mnt") as d:
            path = d.blob(layer.blob)
            assert read_errno(path) in (errno.ENOENT, errno.EIO)
            with pytest.raises(OSError) as ei:
                os.stat(path)
            assert ei.value.errno in (errno.ENOENT, errno.EIO)
            # the other layer, whose map is genuine, is still served
            assert d.blob(other.blob).read_bytes() == other.path.read_bytes()
