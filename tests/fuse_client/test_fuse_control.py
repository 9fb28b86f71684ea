"""The seams of the node cache: errors cross the control socket as their own class (and the CLI
exits with its code), the blocking client imports no trio, the FUSE front end touches no field of
the cache, and fetches retry on the project's one policy."""

from __future__ import annotations

import ast
import contextlib
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio
from testkit.cli_helpers import assert_clean_failure, layerctl

import fuse_client
from fuse_client.control import DaemonNotRunning, request_json, socket_path
from fuse_client.control.server import ControlAPI, ControlServer
from fuse_client.nodecache import BlobIncomplete, CacheBusy, Fetcher, NodeCache, SingleChunkSource, Stats, open_cache
from layerstore import keys
from layerstore.chunkmap import ChunkMap
from layerstore.errors import CorruptObject, NodeUnavailable, NotFound, StoreUnavailable, from_wire
from layerstore.store import Store
from tests.fuse_client.test_fuse_handlers import CHUNK, put_blob, rig


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store.open(str(tmp_path / "store"))
    s.init()
    return s


def _corrupt_chunk_map(store: Store, blob: str) -> None:
    path = store.backend.root / keys.object_key("blobs", blob)  # type: ignore[attr-defined]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


# -- errors across the socket ---------------------------------------------------------------------
@pytest.mark.root
@pytest.mark.trio
async def test_errors_keep_their_class_and_exit_code_across_the_socket(store: Store, tmp_path: Path) -> None:
    cmap = put_blob(store, bytes(range(256)) * 1024)
    _corrupt_chunk_map(store, cmap.blob)
    partial = put_blob(store, bytes([1]) * CHUNK + bytes([2]) * CHUNK + bytes([3]) * CHUNK)
    cache_dir = tmp_path / "cache"
    async with rig(store, cache_dir) as r, trio.open_nursery() as nursery:
        await nursery.start(ControlServer(socket_path(cache_dir), ControlAPI(r.lazy)).serve)
        # The daemon meets a corrupt chunk map: the client raises CorruptObject, the CLI exits 4.
        with pytest.raises(CorruptObject):
            await trio.to_thread.run_sync(request_json, cache_dir, "POST", "/prefetch", {"blob": cmap.blob})
        res = await trio.to_thread.run_sync(layerctl, "prefetch", "--cache", str(cache_dir), cmap.blob)
        assert res.code == 4, res
        assert_clean_failure(res, cmap.blob)
        # Extra fields come along: how much of a blob is missing.
        fh = await r.open_blob(partial.blob)
        await r.fs.read(fh, 0, 10)
        with pytest.raises(BlobIncomplete) as ei:
            await trio.to_thread.run_sync(request_json, cache_dir, "POST", "/pin",
                                          {"blob": partial.blob, "holder": "h"})
        assert ei.value.missing_bytes == 2 * CHUNK
        res = await trio.to_thread.run_sync(layerctl, "cache", "pin", "--cache", str(cache_dir), partial.blob,
                                            "--holder", "h")
        assert res.code == 3, res
        nursery.cancel_scope.cancel()


def test_from_wire_rebuilds_the_node_cache_errors() -> None:
    err = from_wire(BlobIncomplete("not complete", 123).to_wire())
    assert type(err) is BlobIncomplete and err.missing_bytes == 123 and str(err) == "not complete"
    assert type(from_wire(CacheBusy("busy").to_wire())) is CacheBusy
    assert type(from_wire(DaemonNotRunning("gone").to_wire())) is DaemonNotRunning


def test_no_daemon_and_a_busy_cache_are_node_unavailable(store: Store, tmp_path: Path) -> None:
    assert issubclass(DaemonNotRunning, NodeUnavailable) and issubclass(CacheBusy, NodeUnavailable)
    assert DaemonNotRunning.exit_code == CacheBusy.exit_code == 7
    cache_dir = tmp_path / "cache"
    r = layerctl("stats", "--cache", str(cache_dir))
    assert r.code == 7
    assert_clean_failure(r, "no daemon")
    with contextlib.ExitStack() as stack:
        open_cache(cache_dir, None, stack)  # holds the cache lock, as a hung daemon would
        r = layerctl("cache", "ls", "--cache", str(cache_dir))
        assert r.code == 7
        assert_clean_failure(r, "in use")


def test_the_blocking_client_imports_no_trio() -> None:
    for mod in ("fuse_client.control.client", "fuse_client.control"):
        p = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {mod}"], capture_output=True,
                           text=True, check=True)
        assert "trio" not in p.stderr, mod


# -- the front end uses the API only ----------------------------------------------------------------
CACHE_FIELDS = {"present", "last_use", "use_dirty", "busy", "open_count", "streams", "fd", "is_meta", "pins",
                "entries", "usage", "view", "mapped", "io_lock", "closed", "files", "index"}


def test_the_fuse_front_end_never_touches_cache_fields() -> None:
    front = Path(fuse_client.__file__).parent / "fuse"
    found = []
    for path in sorted(front.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in CACHE_FIELDS:
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
    assert found == []


# -- retries -------------------------------------------------------------------------------------
class Failing(SingleChunkSource):
    """A store whose every call fails with `error`, recording when it was asked."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.calls: list[float] = []

    def get_chunk_map(self, blob: str) -> ChunkMap:
        self.calls.append(time.monotonic())
        raise self.error

    def get_chunk(self, digest: str, max_length: int = 1 << 26) -> bytes:
        self.calls.append(time.monotonic())
        raise self.error


@pytest.mark.trio
@pytest.mark.parametrize("error, tries", [(StoreUnavailable("down"), 5), (NotFound("no such blob"), 1),
                                          (CorruptObject("bad map"), 1)])
async def test_chunk_map_fetches_retry_temporary_failures_on_the_shared_policy(
        tmp_path: Path, error: Exception, tries: int) -> None:
    source = Failing(error)
    with contextlib.ExitStack() as stack:
        cache: NodeCache = open_cache(tmp_path / "cache", None, stack)
        async with trio.open_nursery() as nursery:
            fetcher = Fetcher(source, cache, Stats(), nursery=nursery, deadline=1.0)
            with pytest.raises(type(error)):
                await fetcher.entry("b3:" + "1" * 64)
            nursery.cancel_scope.cancel()
    # 50 ms doubling: tries at 0, 0.05, 0.15, 0.35, 0.75; the next (0.8 s later) would end past 1 s.
    assert len(source.calls) == tries
    gaps = [b - a for a, b in zip(source.calls, source.calls[1:], strict=False)]
    for got, want in zip(gaps, [0.05, 0.1, 0.2, 0.4], strict=False):
        assert got >= want - 0.005, gaps


@pytest.mark.trio
async def test_chunk_fetches_retry_a_missing_chunk_but_not_a_corrupt_one(store: Store, tmp_path: Path) -> None:
    """A chunk the store lacks means the store is missing (a renamed store directory): it may come
    back, so the read retries until its deadline. A corrupt chunk fails at once."""
    cmap = put_blob(store, bytes(range(256)) * 1024)

    class Gone(Failing):
        def get_chunk_map(self, blob: str) -> ChunkMap:
            return store.get_chunk_map(blob)

    for error, tries in ((NotFound("chunk gone"), 4), (CorruptObject("bad chunk"), 1)):
        source = Gone(error)
        with contextlib.ExitStack() as stack:
            cache = open_cache(tmp_path / f"cache-{tries}", None, stack)
            async with trio.open_nursery() as nursery:
                fetcher = Fetcher(source, cache, Stats(), nursery=nursery, deadline=0.5)
                entry = await fetcher.entry(cmap.blob)
                with pytest.raises(StoreUnavailable if tries > 1 else CorruptObject):
                    await fetcher.ensure(entry, [0])
                nursery.cancel_scope.cancel()
        # tries at 0, 0.05, 0.15, 0.35; the next (0.4 s later) would end past 0.5 s
        assert len(source.calls) == tries, (error, source.calls)


def test_the_node_cache_knows_no_transport() -> None:
    lib = Path(fuse_client.__file__).parent / "nodecache"
    found = []
    for path in sorted(lib.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                if name.split(".")[0] in ("pyfuse3", "http", "httpx", "fastapi") or \
                        name.startswith(("fuse_client.fuse", "fuse_client.control", "fuse_client.daemon")):
                    found.append(f"{path.name}: {name}")
    assert found == []


@pytest.mark.trio
async def test_a_reader_through_the_library_api(store: Store, tmp_path: Path) -> None:
    data = random.Random(5).randbytes(3 * CHUNK) + b"tail"
    cmap = put_blob(store, data, meta=(0,))
    async with rig(store, tmp_path / "cache") as r:
        lazy = r.lazy
        entry = await lazy.entry(cmap.blob)
        assert entry.size == len(data) and entry.metadata_missing() == [0]
        await lazy.ensure_metadata(entry)
        assert entry.metadata_missing() == [] and lazy.blobs() == [(cmap.blob, len(data))]
        reader = lazy.open_reader(entry)
        assert reader.read_cached(10, 100) == data[10:110]
        assert reader.read_cached(CHUNK + 5, 100) is None  # missing: the caller awaits read_missing
        assert bytes(await reader.read_missing(CHUNK + 5, 100)) == data[CHUNK + 5:CHUNK + 105]
        assert bytes(reader.read_cached(CHUNK + 5, 100)) == data[CHUNK + 5:CHUNK + 105]  # type: ignore[arg-type]
        assert reader.read_cached(len(data), 10) == b""
        st = lazy.stats.blobs[cmap.blob]
        assert (st.hits, st.misses) == (2, 1)
        assert r.cache.ls()["blobs"][0]["open"] == 1
        reader.close()
        reader.close()  # idempotent
        assert r.cache.ls()["blobs"][0]["open"] == 0
