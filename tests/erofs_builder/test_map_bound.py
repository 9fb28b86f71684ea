"""The bound on a chunk map's entries (issue 27): every map our builder makes is within it (its
chunks are whole 4 KiB blocks), and a map over it is refused from its header alone."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from testkit.hostile_maps import one_byte_map

from erofs_builder.build import build_layer
from erofs_builder.chunking import ChunkPolicy, DataExtent, ImageLayout, MetaSegment, check_cover, cut
from layerstore import chunkmap
from layerstore.chunkmap import ChunkMap, ChunkRef, max_entries
from layerstore.errors import CorruptObject
from layerstore.store import MAP_FIRST_READ, Store

from .test_erofs_hypothesis import releases, trees

BS = 4096


def _within(size: int, refs: list[ChunkRef]) -> None:
    # every chunk whole blocks: then entries <= size / 4096 at any scale, the bound's premise
    assert all(r.length % BS == 0 for r in refs), [r.length for r in refs if r.length % BS]
    assert len(refs) <= max(1, size // BS) and len(refs) <= max_entries(size)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(tree=trees(), tails=st.sampled_from([True, False]))
def test_every_map_the_builder_makes_is_within_the_bound(tree: list[Any], tails: bool) -> None:
    """Small files, tails (packed inline or not), holes, big files cut at 1 MiB, hard links,
    xattrs (shared ones go to the data area): every chunk is whole blocks."""
    with tempfile.TemporaryDirectory(prefix="bound-") as tmp:
        layer = build_layer([(e, p) for e, p, _c in tree], Path(tmp) / "a.img", pack_tails=tails)
        _within(layer.size, layer.refs)
        assert ChunkMap.decode(ChunkMap.build(layer.refs).encode(), layer.blob).chunks == tuple(layer.refs)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(pair=releases())
def test_every_map_built_on_a_parent_is_within_the_bound(pair: tuple[list[Any], list[Any]]) -> None:
    """A release built on its parent (inherited cuts, kept blocks, appended records)."""
    first, second = pair
    with tempfile.TemporaryDirectory(prefix="bound-") as tmp:
        a = build_layer([(e, p) for e, p, _c in first], Path(tmp) / "a.img")
        b = build_layer([(e, p) for e, p, _c in second], Path(tmp) / "b.img", parent=a)
        _within(a.size, a.refs)
        _within(b.size, b.refs)


@st.composite
def layouts(draw: Any) -> ImageLayout:
    """Layouts as the writer makes them (block-aligned runs of whole blocks, metadata groups of
    whole blocks), with enough extents for maps well over SMALL_MAP entries."""
    n = draw(st.integers(1, 12_000))
    seed = draw(st.integers(0, 1 << 30))
    exts, pos = [], BS
    for i in range(n):
        x = (seed + i * 0x9E3779B1) & 0xFFFFFFFF
        blocks = 1 + x % 3 if x % 5 else 16 + x % 600  # mostly one-to-three-block files, some big ones
        exts.append(DataExtent(pos, blocks * BS, x, meta=x % 97 == 0))
        pos += blocks * BS
    data_end = pos
    meta = []
    for i in range(draw(st.integers(0, 400))):
        blocks = 1 + (seed >> (i % 20)) % 5
        meta.append(MetaSegment(pos, blocks * BS, bool(i % 2), hint=i * 7919, dirs=i % 3 == 0, grouped=bool(i % 4)))
        pos += blocks * BS
    return ImageLayout(size=pos, data_start=BS, data_end=data_end, extents=tuple(exts), meta=tuple(meta))


@settings(max_examples=25, deadline=None)
@given(layout=layouts(), policy=st.sampled_from([ChunkPolicy(), ChunkPolicy(meta_target=0),
                                                 ChunkPolicy(min_group=16 << 10, target_group=64 << 10,
                                                             max_group=128 << 10)]))
def test_cuts_of_large_layouts_are_within_the_bound(layout: ImageLayout, policy: ChunkPolicy) -> None:
    cuts = cut(layout, policy)
    check_cover(cuts, layout.size)
    _within(layout.size, [ChunkRef(c.offset, c.length, "b3:" + "0" * 64) for c in cuts])


def test_the_bound() -> None:
    assert max_entries(0) == max_entries(1) == chunkmap.SMALL_MAP
    assert max_entries(64 << 20) == (64 << 20) // BS
    assert max_entries(16 << 30) == chunkmap.MAX_ENTRIES == max_entries(1 << 60)


@pytest.mark.parametrize("entries", [chunkmap.SMALL_MAP + 1, 30_000])
def test_a_map_over_the_bound_is_refused_from_its_header(entries: int) -> None:
    """The issue's map, smaller: 1-byte chunks, more than SMALL_MAP of them. Old code decoded it
    (its chunk list does hash to its id)."""
    blob, data = one_byte_map(entries)
    for part in (data[:chunkmap.HEADER_SIZE], data):
        with pytest.raises(CorruptObject, match="more than 4096"):
            chunkmap.check_head(part, blob)
        with pytest.raises(CorruptObject, match="more than 4096"):
            ChunkMap.decode(part, blob)
    refs = [ChunkRef(i, 1, "b3:" + "0" * 64) for i in range(entries)]
    with pytest.raises(CorruptObject, match="more than 4096"):
        ChunkMap.build(refs)  # nor can a writer make one


def test_a_header_whose_entries_cannot_cover_its_size_is_refused() -> None:
    blob, data = one_byte_map(2)
    head = bytearray(data[:chunkmap.HEADER_SIZE])
    head[12:20] = (3 * chunkmap.MAX_CHUNK_LEN).to_bytes(8, "little")
    with pytest.raises(CorruptObject, match="cannot cover"):
        chunkmap.check_head(head, blob)


def test_the_store_reads_only_the_head_of_a_map_over_the_bound(tmp_path: Path) -> None:
    """Old code read the whole map (1.4 MB here, 192 MiB in the issue) and decoded it."""
    blob, data = one_byte_map(30_000)
    assert len(data) > MAP_FIRST_READ
    with Store.open(str(tmp_path / "s")) as store:
        store.init()
        store.backend.store_once(chunkmap_key(blob), data)
        reads: list[int] = []
        real = store.backend.load

        def load(*a: Any, **kw: Any) -> bytes:
            out = real(*a, **kw)
            reads.append(len(out))
            return out

        store.backend.load = load  # type: ignore[method-assign]
        with pytest.raises(CorruptObject, match="more than 4096"):
            store.get_chunk_map(blob)
        assert reads == [MAP_FIRST_READ]


def test_the_store_reads_a_large_map_in_two_reads(tmp_path: Path) -> None:
    refs = [ChunkRef(i * BS, BS, "b3:%064x" % (i % 7)) for i in range(30_000)]
    cm = ChunkMap.build(refs)
    with Store.open(str(tmp_path / "s")) as store:
        store.init()
        store.backend.store_once(chunkmap_key(cm.blob), cm.encode())
        assert store.get_chunk_map(cm.blob) == cm
        store.backend.store_once(chunkmap_key(ChunkMap.build(refs[:10]).blob), ChunkMap.build(refs[:10]).encode())
        assert store.get_chunk_map(ChunkMap.build(refs[:10]).blob).chunks == tuple(refs[:10])


def chunkmap_key(blob: str) -> str:
    from layerstore import keys

    return keys.object_key("blobs", blob)
