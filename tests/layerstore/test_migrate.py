"""Stores written by an older layerstore (chunk map format 1: a blob's id was the blake3 of its
whole content): refused on read with what to do, and `layerctl store migrate` re-keys a map
only after the whole blob matched its old id."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import blake3
import pytest
from testkit.cli_helpers import assert_clean_failure, layerctl

from layerstore import digest as digestmod
from layerstore import keys
from layerstore.chunkmap import ChunkMap, ChunkRef
from layerstore.errors import CorruptObject
from layerstore.store import Store

CHUNK = 64 * 1024


def format_1_map(blob: str, refs: tuple[ChunkRef, ...]) -> bytes:
    """A chunk map as layerstore wrote it before: header with the whole-file digest, entries,
    a trailing blake3."""
    size = refs[-1].end if refs else 0
    body = struct.pack("<4sB3xIQ32s", b"LSCM", 1, len(refs), size, digestmod.raw_of(blob))
    body += b"".join(struct.pack("<QII32s", r.offset, r.length, r.flags, digestmod.raw_of(r.digest)) for r in refs)
    return body + blake3.blake3(body).digest()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store.open(str(tmp_path / "store")) as s:
        s.init()
        yield s


def _old_blob(store: Store, tmp_path: Path, data: bytes, name: str = "blob") -> tuple[str, ChunkMap]:
    """Store `data` the old way: its chunks, and a format-1 map under its whole-file digest."""
    path = tmp_path / name
    path.write_bytes(data)
    cm = store.get_chunk_map(store.put_blob(path, chunk_size=CHUNK).blob)
    old = digestmod.of(data)
    store.backend.store_once(keys.object_key("blobs", old), format_1_map(old, cm.chunks))
    store.backend.delete(keys.object_key("blobs", cm.blob))  # as if only the old map existed
    return old, cm


def test_old_map_is_refused_with_what_to_do(store: Store, tmp_path: Path) -> None:
    old, _ = _old_blob(store, tmp_path, b"x" * 200_000)
    with pytest.raises(CorruptObject, match="older layerstore.*rebuild the layer and push it again"):
        store.get_chunk_map(old)


def test_migrate_rekeys_after_checking_the_whole_blob(store: Store, tmp_path: Path) -> None:
    data = bytes(range(256)) * 1000
    old, cm = _old_blob(store, tmp_path, data)
    assert store.migrate_chunk_map(old) == cm.blob
    assert store.get_chunk_map(cm.blob) == cm
    assert store.migrate_chunk_map(cm.blob) is None  # format 2 already


def test_migrate_refuses_a_map_that_is_not_its_blobs(store: Store, tmp_path: Path) -> None:
    """A format-1 map whose chunks are not the blob its old id named is never re-keyed (a
    hostile writer cannot launder a forged old map through the migration)."""
    _, other = _old_blob(store, tmp_path, b"other" * 50_000, "other")
    claimed = digestmod.of(b"the signed layer's content")
    store.backend.store_once(keys.object_key("blobs", claimed), format_1_map(claimed, other.chunks))
    with pytest.raises(CorruptObject, match="not re-keyed"):
        store.migrate_chunk_map(claimed)
    assert not store.has_blob(other.blob)


def test_cli_migrate(store: Store, tmp_path: Path) -> None:
    old, cm = _old_blob(store, tmp_path, b"y" * 300_000)
    r = layerctl("store", "migrate", "--store", store.url, "--json")
    assert r.code == 0, r.err
    assert r.json() == {"migrated": {old: cm.blob}, "refused": {}}
    r = layerctl("store", "get-blob", "--store", store.url, old, str(tmp_path / "out"))
    assert_clean_failure(r, "older layerstore")
    assert layerctl("store", "get-blob", "--store", store.url, cm.blob, str(tmp_path / "out")).code == 0
    assert (tmp_path / "out").read_bytes() == b"y" * 300_000
