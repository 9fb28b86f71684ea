"""One conformance suite, run against every backend: a local directory, CephFS through ceph-fuse,
S3 on radosgw (both on the real single-node Ceph the harness starts), and the HTTP store service
in front of a local directory and in front of radosgw."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from testkit.blob_ids import put_blob_id

from layerstore import chunkobj, keys
from layerstore import digest as digestmod
from layerstore.backends import Backend, open_backend
from layerstore.backends.http_wire import RejectedObject
from layerstore.chunker import DEFAULT_CHUNK_SIZE
from layerstore.errors import BadKey, CorruptObject, NotFound
from layerstore.store import Store

# (the Ceph ones carry the mark: skipped where Ceph is absent, deselected by `make check`)
BACKENDS = ["local", pytest.param("cephfs", marks=pytest.mark.ceph), pytest.param("s3", marks=pytest.mark.ceph),
            "http", pytest.param("http-s3", marks=pytest.mark.ceph)]
# The store behind a service's URL (where a test plants what the service refuses to write).
BEHIND: dict[str, str] = {}


@pytest.fixture(params=BACKENDS)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "local":
        yield str(tmp_path / "store")
    elif request.param == "cephfs":
        yield request.getfixturevalue("cephfs_store_url")
    elif request.param == "s3":
        yield request.getfixturevalue("s3_store_url")
    else:
        from testkit.store_service import threaded_service

        inner = str(tmp_path / "store") if request.param == "http" else request.getfixturevalue("s3_store_url")
        with threaded_service(inner) as url:
            BEHIND[url] = inner
            try:
                yield url
            finally:
                BEHIND.pop(url, None)


def behind(backend: Backend) -> Backend:
    """The backend a test may corrupt directly: the store behind a service, else `backend`."""
    inner = BEHIND.get(backend.url)
    return open_backend(inner) if inner else backend


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    with Store.open(store_url) as s:
        s.init()
        yield s


@pytest.fixture
def backend(store: Store) -> Backend:
    return store.backend


def _payload(n: int, seed: int = 0) -> bytes:
    # Cheap, deterministic and poorly compressible.
    out = bytearray()
    block = digestmod.raw_of(digestmod.of(seed.to_bytes(8, "little")))
    while len(out) < n:
        block = digestmod.raw_of(digestmod.of(block))
        out += block * 4 + bytes(range(len(out) % 251, 256))
    return bytes(out[:n])


# -- raw backend ------------------------------------------------------------------------
class TestBackend:
    def test_init_is_idempotent(self, store: Store) -> None:
        assert store.init() is False
        store.check()

    @pytest.mark.parametrize("size", [0, 1, 4096, DEFAULT_CHUNK_SIZE + 17])
    def test_store_once_and_load(self, backend: Backend, size: int) -> None:
        data = _payload(size, size)
        assert backend.store_once("t/obj", data) is True
        assert backend.store_once("t/obj", b"other") is False
        assert backend.load("t/obj") == data
        assert backend.exists("t/obj")
        assert backend.size("t/obj") == size

    def test_ranged_reads(self, backend: Backend) -> None:
        data = _payload(100_000)
        backend.store_once("t/ranged", data)
        assert backend.load("t/ranged", 0, 10) == data[:10]
        assert backend.load("t/ranged", 4096, 5000) == data[4096:9096]
        assert backend.load("t/ranged", 99_990, 100) == data[99_990:]
        assert backend.load("t/ranged", 50_000) == data[50_000:]
        assert backend.load("t/ranged", 100_000, 10) == b""
        assert backend.load("t/ranged", 200_000, 10) == b""
        assert backend.load("t/ranged", 10, 0) == b""

    def test_load_refuses_more_than_max_size(self, backend: Backend) -> None:
        """`max_size` bounds the whole object (whatever the range): a larger one is a
        `CorruptObject`, raised from its length before its body is read."""
        data = _payload(10_000)
        backend.store_once("t/limit", data)
        assert backend.load("t/limit", max_size=10_000) == data
        assert backend.load("t/limit", 100, 10, max_size=10_000) == data[100:110]
        for args in ((), (0, 10), (50,), (10, 0)):
            with pytest.raises(CorruptObject, match="more than"):
                backend.load("t/limit", *args, max_size=9_999)
        backend.store_once("t/empty", b"")
        assert backend.load("t/empty", max_size=0) == b""
        with pytest.raises(NotFound):
            backend.load("t/missing", max_size=5)

    def test_missing(self, backend: Backend) -> None:
        assert not backend.exists("t/missing")
        with pytest.raises(NotFound):
            backend.load("t/missing")
        with pytest.raises(NotFound):
            backend.load("t/missing", 5, 5)
        with pytest.raises(NotFound):
            backend.size("t/missing")
        with pytest.raises(NotFound):
            backend.delete("t/missing")

    def test_delete(self, backend: Backend) -> None:
        backend.store_once("t/gone", b"x")
        backend.delete("t/gone")
        assert not backend.exists("t/gone")
        assert list(backend.list("t/")) == []
        assert backend.store_once("t/gone", b"y") is True
        assert backend.load("t/gone") == b"y"

    def test_replace(self, backend: Backend) -> None:
        backend.replace("t/mutable", b"one")
        backend.replace("t/mutable", b"two")
        assert backend.load("t/mutable") == b"two"

    def test_replace_if(self, backend: Backend) -> None:
        assert backend.replace_if("t/cas", b"one", None) is True
        assert backend.replace_if("t/cas", b"two", None) is False
        assert backend.replace_if("t/cas", b"two", b"not it") is False
        assert backend.replace_if("t/cas", b"two", b"on") is False
        assert backend.load("t/cas") == b"one"
        assert backend.replace_if("t/cas", b"two", b"one") is True
        assert backend.load("t/cas") == b"two"
        assert backend.replace_if("t/nothing", b"x", b"y") is False
        assert not backend.exists("t/nothing")
        assert [k for k in backend.list("t/")] == ["t/cas"]  # no lock or temporary shows

    def test_replace_if_race(self, store_url: str) -> None:
        """Several writers move one object from the same value at once: exactly one wins, and
        the object holds the winner's bytes."""
        n = 6
        with contextlib.closing(open_backend(store_url)) as b:
            b.replace("t/raced", b"start")
        barrier = threading.Barrier(n)

        def writer(i: int) -> bool:
            with contextlib.closing(open_backend(store_url)) as b:
                barrier.wait()
                return b.replace_if("t/raced", f"writer {i}".encode(), b"start")

        with ThreadPoolExecutor(n) as pool:
            won = list(pool.map(writer, range(n)))
        assert won.count(True) == 1, won
        with contextlib.closing(open_backend(store_url)) as b:
            assert b.load("t/raced") == f"writer {won.index(True)}".encode()

    def test_bad_keys(self, backend: Backend) -> None:
        for bad in ["../escape", "/abs", "a//b", ".tmp-x"]:
            with pytest.raises(BadKey):
                backend.store_once(bad, b"x")
            with pytest.raises(BadKey):
                backend.load(bad)

    @pytest.mark.slow  # about 3-5 s: kept out of `make check`'s 2 minutes
    def test_list_thousands(self, backend: Backend) -> None:
        names = [f"many/{i % 7}/k{i:05d}" for i in range(1500)]
        with ThreadPoolExecutor(16) as pool:
            assert all(pool.map(lambda k: backend.store_once(k, k.encode()), names))
        backend.store_once("manyother/x", b"x")
        assert sorted(backend.list("many/")) == sorted(names)
        assert sorted(backend.list("many/3/")) == sorted(n for n in names if n.startswith("many/3/"))
        assert sorted(backend.list("many/3/k0001")) == sorted(n for n in names if n.startswith("many/3/k0001"))
        assert "manyother/x" in set(backend.list("many"))
        assert list(backend.list("nothing/")) == []

    def test_version_changes_when_an_object_is_written_again(self, backend: Backend) -> None:
        """Where a backend has versions (`Backend.version`), a rewrite changes it; none for a
        missing object; a backend without them answers None throughout."""
        assert backend.version("ver/absent") is None
        backend.replace("ver/t", b"one")
        v1 = backend.version("ver/t")
        if v1 is None:
            return  # (no versions here: callers read the object)
        assert backend.version("ver/t") == v1
        backend.replace("ver/t", b"two")
        assert backend.version("ver/t") != v1
        backend.delete("ver/t")
        assert backend.version("ver/t") is None

    def test_list_info(self, backend: Backend) -> None:
        import time

        before = time.time()
        backend.store_once("info/a", b"12345")
        backend.replace("info/b/c", b"")
        infos = {i.key: i for i in backend.list_info("info/")}
        assert set(infos) == {"info/a", "info/b/c"}
        assert (infos["info/a"].size, infos["info/b/c"].size) == (5, 0)
        for info in infos.values():
            # the store's clock, not ours: allow for a little skew between them
            assert before - 60 < info.mtime < time.time() + 60
        assert [i.key for i in backend.list_info("info/b/")] == ["info/b/c"]
        assert list(backend.list_info("none/")) == []

    @pytest.mark.slow  # about 3-5 s: kept out of `make check`'s 2 minutes
    def test_delete_many(self, backend: Backend) -> None:
        names = [f"dm/{i % 3}/k{i:04d}" for i in range(1100)]  # the first delete is more than one S3 batch
        with ThreadPoolExecutor(16) as pool:
            assert all(pool.map(lambda k: backend.store_once(k, b"x"), names))
        backend.store_once("dmkeep/x", b"x")
        assert backend.delete_many(iter(names[:1050])) == 1050
        assert sorted(backend.list("dm/")) == sorted(names[1050:])
        # keys already gone are not an error
        backend.delete_many(names)
        assert list(backend.list("dm/")) == []
        assert backend.exists("dmkeep/x")
        assert backend.delete_many([]) == 0

    @pytest.mark.slow  # about 2-3 s: kept out of `make check`'s 2 minutes
    def test_store_once_race(self, store_url: str) -> None:
        """Several processes write one key at once: exactly one write lands, everyone then
        reads the same bytes."""
        ctx = multiprocessing.get_context("spawn")
        n = 6
        barrier = ctx.Barrier(n)
        results = ctx.Queue()
        procs = [ctx.Process(target=_race_writer, args=(store_url, i, barrier, results)) for i in range(n)]
        for p in procs:
            p.start()
        outcomes = [results.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
        winners = [i for i, won, _ in outcomes if won]
        assert len(winners) == 1, outcomes
        seen = {data for _, _, data in outcomes}
        assert seen == {_race_payload(winners[0])}


def _race_payload(i: int) -> bytes:
    return f"writer {i} ".encode() * 50_000


def _race_writer(url: str, i: int, barrier, results) -> None:  # noqa: ANN001
    b = open_backend(url)
    barrier.wait()
    won = b.store_once("race/key", _race_payload(i))
    results.put((i, won, b.load("race/key")))


# -- the store on top ---------------------------------------------------------------------
class TestStore:
    @pytest.mark.parametrize("size", [0, 1, DEFAULT_CHUNK_SIZE, 3 * DEFAULT_CHUNK_SIZE + 12345])
    def test_blob_round_trip(self, store: Store, tmp_path: Path, size: int) -> None:
        src = tmp_path / "src"
        src.write_bytes(_payload(size, 7))
        res = store.put_blob(src)
        assert res.blob == put_blob_id(src)
        assert res.size == size
        assert res.chunks == -(-size // DEFAULT_CHUNK_SIZE)
        assert res.new_bytes == size
        assert store.put_blob(src).new_bytes == 0
        out = tmp_path / "out"
        with open(out, "wb") as f:
            assert store.read_blob(res.blob, f.fileno()) == size
        assert out.read_bytes() == src.read_bytes()

    def test_duplicate_chunks_stored_once(self, store: Store, tmp_path: Path) -> None:
        src = tmp_path / "src"
        src.write_bytes(_payload(DEFAULT_CHUNK_SIZE, 1) * 3)
        res = store.put_blob(src)
        assert res.chunks == 3 and res.new_bytes == DEFAULT_CHUNK_SIZE
        assert len(list(store.list_digests("chunks"))) == 1

    def test_missing_blob_and_chunk(self, store: Store) -> None:
        with pytest.raises(NotFound):
            store.get_chunk_map(digestmod.of(b"nothing"))
        with pytest.raises(NotFound):
            store.get_chunk(digestmod.of(b"nothing"))

    def test_flipped_byte_is_corruption(self, store: Store) -> None:
        payload = _payload(50_000, 3)
        chunk, _ = store.put_chunk(payload)
        key = keys.object_key("chunks", chunk)
        raw = bytearray(store.backend.load(key))
        raw[len(raw) // 2] ^= 0x40
        _overwrite(store.backend, key, bytes(raw))
        with pytest.raises(CorruptObject):
            store.get_chunk(chunk)
        assert store.verify().corrupt == [key]

    def test_truncated_object_is_corruption(self, store: Store) -> None:
        chunk, _ = store.put_chunk(_payload(50_000, 4))
        key = keys.object_key("chunks", chunk)
        _overwrite(store.backend, key, store.backend.load(key)[:-100])
        with pytest.raises(CorruptObject):
            store.get_chunk(chunk)
        assert key in store.verify().corrupt

    def test_object_under_wrong_id_is_corruption(self, store: Store) -> None:
        wrong = digestmod.of(b"not this content")
        key = keys.object_key("chunks", wrong)
        behind(store.backend).store_once(key, chunkobj.encode(b"other content")[1])
        with pytest.raises(CorruptObject, match="hashes to"):
            store.get_chunk(wrong)
        assert store.verify().corrupt == [key]

    def test_put_chunk_objects(self, store: Store) -> None:
        """Objects encoded by the caller (a builder compressing while it builds): stored as
        given, read back verified, idempotent; a bad one is refused before anything is stored."""
        payloads = [_payload(n, 20 + n % 7) for n in (1, 5000, 70_000, 300_000)] + [b"z" * 200_000]
        pairs = [chunkobj.encode(p) for p in payloads]
        stats = list(store.put_chunk_objects(pairs))
        assert [s.new_chunks for s in stats] == [1] * len(pairs)
        assert sum(s.new_bytes for s in stats) == sum(map(len, payloads))
        for (ident, obj), p in zip(pairs, payloads, strict=True):
            assert store.backend.load(store.chunk_key(ident)) == obj
            assert store.get_chunk(ident) == p
        assert [s.new_chunks for s in store.put_chunk_objects(pairs)] == [0] * len(pairs)
        ident, obj = chunkobj.encode(_payload(40_000, 99))
        with pytest.raises(CorruptObject):
            store.put_chunk_object(ident, obj[:-1] if obj[5] == chunkobj.COMP_NONE else obj[:8] + obj[16:])
        assert not store.has_chunk(ident)
        assert store.verify().corrupt == []

    def test_chunk_map_never_points_at_missing_chunks(self, store: Store) -> None:
        from layerstore.chunkmap import ChunkMap, ChunkRef

        cm = ChunkMap.build([ChunkRef(0, 1, digestmod.of(b"x"))])
        with pytest.raises(NotFound, match="missing"):
            store.put_chunk_map(cm)
        assert not store.has_blob(cm.blob)

    def test_manifests_and_tags(self, store: Store) -> None:
        m1 = store.put_manifest(b'{"layers":[]}')
        m2 = store.put_manifest(b'{"layers":[1]}')
        assert store.get_manifest(m1) == b'{"layers":[]}'
        store.set_tag("env:v1", m1)
        assert store.get_tag("env:v1") == m1
        store.set_tag("env:v1", m2)
        store.set_tag("team/other:latest", m1)
        assert store.tags() == {"env:v1": m2, "team/other:latest": m1}
        with pytest.raises(NotFound):
            store.set_tag("env:v2", digestmod.of(b"no manifest"))
        with pytest.raises(NotFound):
            store.get_tag("env:nope")
        store.delete_tag("env:v1")
        assert "env:v1" not in store.tags()

    def test_verify_clean_store(self, store: Store, tmp_path: Path) -> None:
        src = tmp_path / "src"
        src.write_bytes(_payload(2 * DEFAULT_CHUNK_SIZE + 5, 9))
        store.put_blob(src)
        store.set_tag("x:1", store.put_manifest(b"{}"))
        report = store.verify()
        assert report.corrupt == []
        assert report.objects == 1 + 3 + 1 + 1 + 1  # config, chunks, chunk map, manifest, tag


def _overwrite(backend: Backend, key: str, data: bytes) -> None:
    """Replace an object's bytes behind the store's back, as disk rot or a bad writer would (a
    store service refuses to write them: they are planted in the store behind it)."""
    raw = behind(backend)
    if raw is not backend:
        with pytest.raises(RejectedObject):
            backend.replace(key, data)
    raw.delete(key)
    assert raw.store_once(key, data)


def test_uninitialised_store_is_refused(tmp_path: Path) -> None:
    with Store.open(str(tmp_path / "nothing")) as s, pytest.raises(NotFound, match="store init"):
        s.check()
    (tmp_path / "empty").mkdir()
    with Store.open(str(tmp_path / "empty")) as s, pytest.raises(NotFound, match="not a layerstore store"):
        s.check()


def test_posix_writes_leave_no_temporaries(tmp_path: Path) -> None:
    with Store.open(str(tmp_path / "s")) as s:
        s.init()
        s.put_chunk(b"abc")
        s.set_tag("a:b", s.put_manifest(b"{}"))
    leftovers = [p for p in (tmp_path / "s").rglob(".tmp-*")]
    assert leftovers == []
    assert os.listdir(tmp_path / "s")
