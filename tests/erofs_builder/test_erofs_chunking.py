"""Chunk cuts (pure), cross-image dedup, and pushing a layer to a local store."""

from __future__ import annotations

import os
import random
from pathlib import Path

from testkit.erofs_helpers import make_tree

from erofs_builder.build import build_layer, push_layer
from erofs_builder.chunking import ChunkPolicy, DataExtent, ImageLayout, MetaSegment, check_cover, cut
from erofs_builder.sources.source_dir import dir_entries
from layerstore.chunkmap import METADATA, ChunkMap
from layerstore.store import Store

MiB = 1 << 20


def restored(store: Store, blob: str, out: Path) -> bytes:
    """The blob as the store gives it back (`read_blob` into `out`), checked against its size."""
    fd = os.open(out, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        size = store.read_blob(blob, fd)
    finally:
        os.close(fd)
    data = out.read_bytes()
    assert size == len(data)
    return data


def test_cut_covers_and_respects_extents() -> None:
    exts = []
    pos = 4096
    sizes = [4096, 8192, 3 * MiB + 4096, 4096 * 5, 300 << 10, 4096] + [4096 * (i % 9 + 1) for i in range(400)]
    for i, n in enumerate(sizes):
        exts.append(DataExtent(pos, n, (i * 2654435761) & 0xFFFFFFFF))
        pos += n
    meta = [MetaSegment(pos, 8192, False), MetaSegment(pos + 8192, 20480, True), MetaSegment(pos + 28672, 4096, True)]
    layout = ImageLayout(size=pos + 32768, data_start=4096, data_end=pos, extents=tuple(exts), meta=tuple(meta))
    cuts = cut(layout)
    check_cover(cuts, layout.size)
    starts = {c.offset for c in cuts}
    for e in exts:  # a cut never splits a small extent; a big one is cut from its own start
        if e.length < ChunkPolicy().big:
            assert not any(e.offset < s < e.offset + e.length for s in starts)
        else:
            inner = sorted(s for s in starts if e.offset <= s < e.offset + e.length)
            assert inner == list(range(e.offset, e.offset + e.length, MiB))
    assert all(c.length <= MiB for c in cuts)
    assert cuts[0].flags == METADATA and cuts[0].length == 4096
    assert all((c.flags == METADATA) == (c.offset >= pos or c.offset == 0) for c in cuts)
    assert [c.offset for c in cuts if c.offset >= pos] == [pos, pos + 8192, pos + 28672]


def test_cut_group_boundaries_are_local() -> None:
    """Changing one small extent only disturbs the groups around it."""
    def layout(sizes: list[int], hints: list[int]) -> ImageLayout:
        exts, pos = [], 4096
        for n, h in zip(sizes, hints, strict=True):
            exts.append(DataExtent(pos, n, h))
            pos += n
        return ImageLayout(size=pos, data_start=4096, data_end=pos, extents=tuple(exts))

    sizes = [4096 * (i % 13 + 1) for i in range(2000)]
    hints = [(i * 0x5BD1E995 + 7) & 0xFFFFFFFF for i in range(2000)]
    a = cut(layout(sizes, hints))
    sizes2, hints2 = list(sizes), list(hints)
    sizes2[1000] += 8192
    hints2[1000] ^= 0xABCDEF
    b = cut(layout(sizes2, hints2))
    lens_a = [c.length for c in a]
    lens_b = [c.length for c in b]
    same = len(set(lens_a) & set(lens_b))
    assert len(a) > 10 and sum(1 for x, y in zip(lens_a, lens_b, strict=False) if x == y) >= len(a) // 2
    assert same


def test_identical_files_give_identical_chunks_across_images(tmp_path: Path) -> None:
    big = os.urandom(5 * MiB + 12345)
    smalls = {f"lib/mod{i}.py": os.urandom(5000 + i * 37) for i in range(300)}
    make_tree(tmp_path / "a", {"big.bin": big, **smalls, "only-a.txt": b"a" * 100})
    make_tree(tmp_path / "b", {"zzz/elsewhere/big.bin": big, **smalls, "aaa/other": os.urandom(MiB // 3),
                               "lib/mod150.py": b"changed"})
    la = build_layer(dir_entries(tmp_path / "a"), tmp_path / "a.img")
    lb = build_layer(dir_entries(tmp_path / "b"), tmp_path / "b.img")
    da = {r.digest for r in la.refs if not r.metadata}
    data_bytes = sum(r.length for r in lb.refs if not r.metadata)
    shared = sum(r.length for r in lb.refs if not r.metadata and r.digest in da)
    assert shared >= len(big)
    assert shared >= 0.7 * data_bytes, (shared, data_bytes)  # one changed file costs its group(s)


def test_push_layer_stores_missing_chunks_then_the_map(tmp_path: Path) -> None:
    make_tree(tmp_path / "src", {"big": os.urandom(3 * MiB), **{f"s/{i}": os.urandom(i * 50) for i in range(100)}})
    layer = build_layer(dir_entries(tmp_path / "src"), tmp_path / "img")
    with Store.open(str(tmp_path / "store")) as store:
        store.init()
        seen: list[int] = []
        first = push_layer(store, layer, progress=seen.append)
        assert first.new_chunks == len({r.digest for r in layer.refs}) and sum(seen) > 0
        again = push_layer(store, layer)
        assert again.new_chunks == 0
        cm = store.get_chunk_map(layer.blob)
        assert list(cm.chunks) == layer.refs
        assert restored(store, layer.blob, tmp_path / "restored") == layer.path.read_bytes()


def test_failed_build_publishes_nothing(tmp_path: Path) -> None:
    from erofs_builder.tree import Entry, Kind
    from layerstore.errors import BadInput

    def entries():  # type: ignore[no-untyped-def]
        yield Entry(b"ok", Kind.REG, size=3), [b"abc"]
        yield Entry(b"bad", Kind.REG, size=5), [b"abc"]

    import pytest

    with pytest.raises(BadInput):
        build_layer(entries(), tmp_path / "img")
    assert os.listdir(tmp_path) == []


def test_small_inline_files_dedup_in_stable_metadata_groups(tmp_path: Path) -> None:
    """Small files live inline in stable metadata groups; a change elsewhere (a file that grows
    and shifts all data) leaves the untouched groups identical. Merged into bigger chunks (the
    default), they still are, but for the chunk that holds the edit and at most one after it.

    The contents are seeded: groups are content-defined with a minimum length, so an edit that
    takes away its group's end can move the next group's end too (a cut that the minimum held
    back now counts), and so on. In a model of this tree's grouping over 20,000 random contents,
    the edit changed the next group too once in 27 and the next two once in 870 (never more),
    and random contents made this test fail about that often. The rule that keeps it that few
    is checked on its own: test_inline_record_groups_resynchronise_after_an_edit."""
    rng = random.Random(11)
    smalls = {f"pkg/m{i:04d}.py": rng.randbytes(200 + (i * 53) % 3800) for i in range(1500)}
    make_tree(tmp_path / "a", {**smalls, "data.bin": rng.randbytes(MiB)})
    make_tree(tmp_path / "b", {**smalls, "data.bin": rng.randbytes(2 * MiB), "pkg/m0700.py": b"edited"})
    for tree in ("a", "b"):
        for p in (tmp_path / tree).rglob("*"):
            os.utime(p, (1_700_000_000, 1_700_000_000))
    for policy in (ChunkPolicy(meta_target=0), ChunkPolicy()):
        la = build_layer(dir_entries(tmp_path / "a"), tmp_path / "a.img", policy=policy)
        lb = build_layer(dir_entries(tmp_path / "b"), tmp_path / "b.img", policy=policy)
        seen = {r.digest for r in la.refs}
        meta_b = [r for r in lb.refs if r.metadata]
        shared = sum(r.length for r in meta_b if r.digest in seen)
        if not policy.meta_target:
            assert shared >= 0.8 * sum(r.length for r in meta_b), (shared, [r.length for r in meta_b])
        assert lb.layout is not None
        stable_start = min(s.offset for s in lb.layout.meta if s.stable)
        stable_end = max(s.offset + s.length for s in lb.layout.meta if s.stable)
        stable = [r for r in meta_b if stable_start <= r.offset < stable_end]
        assert len(stable) >= 3 and sum(1 for r in stable if r.digest not in seen) <= 2, policy


def test_image_mode_follows_the_umask(tmp_path: Path) -> None:
    """mkstemp creates 0600; the published image is 0644 minus the umask, like a plain create."""
    import stat

    from erofs_builder.build import current_umask

    make_tree(tmp_path / "src", {"f": b"x"})
    old = os.umask(0o022)
    try:
        for mask, want in ((0o022, 0o644), (0o077, 0o600), (0o002, 0o644), (0o027, 0o640)):
            os.umask(mask)
            assert current_umask() == mask
            layer = build_layer(dir_entries(tmp_path / "src"), tmp_path / f"img-{mask:o}")
            assert stat.S_IMODE(layer.path.stat().st_mode) == want, (oct(mask), oct(layer.path.stat().st_mode))
    finally:
        os.umask(old)


def test_directory_blocks_and_shared_xattrs_are_metadata_chunks(tmp_path: Path) -> None:
    """Large directories' entries and the shared xattrs sit in the data area (they hold no
    address of their own there), but readers still fetch them with the metadata."""
    spec: dict[str, object] = {f"big/{i:05d}-{'x' * 40}": os.urandom(5000) for i in range(600)}
    spec.update({f"x{i}": {"data": os.urandom(9000), "xattrs": {"user.shared": b"v" * 50}} for i in range(3)})
    make_tree(tmp_path / "src", spec)  # type: ignore[arg-type]
    layer = build_layer(dir_entries(tmp_path / "src"), tmp_path / "img")
    assert layer.layout is not None
    metas = [e for e in layer.layout.extents if e.meta]
    assert sum(e.length for e in metas) >= 8 * 4096  # the directory's blocks and the xattr area
    for e in metas:
        (ref,) = [r for r in layer.refs if r.offset <= e.offset < r.end]
        assert ref.metadata and e.offset + e.length <= ref.end


def test_cut_groups_metadata_extents_apart() -> None:
    exts = [DataExtent(4096, 8192, 1), DataExtent(12288, 4096, 2, meta=True), DataExtent(16384, 8192, 3, meta=True),
            DataExtent(24576, 300 << 10, 4, meta=True), DataExtent(24576 + (300 << 10), 4096, 5)]
    end = 24576 + (300 << 10) + 4096
    layout = ImageLayout(size=end, data_start=4096, data_end=end, extents=tuple(exts))
    cuts = cut(layout, ChunkPolicy(meta_chunk=64 << 10))
    check_cover(cuts, end)
    assert [(c.offset, c.length, c.flags) for c in cuts[:4]] == [
        (0, 4096, METADATA), (4096, 8192, 0), (12288, 12288, METADATA), (24576, 64 << 10, METADATA)]
    assert all(c.flags == METADATA for c in cuts[3:-1]) and cuts[-1].flags == 0


def test_chunk_digests_match_the_bytes(tmp_path: Path) -> None:
    """Big runs' chunk digests come from the writer's own hashing; every one must still be the
    blake3 of the chunk's bytes (and the blob the id of that chunk list, covering the image)."""
    import blake3

    from erofs_builder.tree import Entry, Hole, Kind

    pieces = [os.urandom(3 * MiB + 5), os.urandom(70_000), os.urandom(100)]
    entries = [(Entry(f"f{i}".encode(), Kind.REG, size=len(p)), [p[:777], p[777:]]) for i, p in enumerate(pieces)]
    sparse = [os.urandom(2 * MiB), Hole(5 * MiB), os.urandom(MiB + 3)]
    entries.append((Entry(b"sparse", Kind.REG, size=8 * MiB + 3), sparse))
    layer = build_layer(entries, tmp_path / "img")
    image = layer.path.read_bytes()
    assert layer.blob == ChunkMap.build(layer.refs).blob and layer.size == len(image)
    for ref in layer.refs:
        assert ref.digest == "b3:" + blake3.blake3(image[ref.offset:ref.end]).hexdigest(), ref


def _random_tree(root: Path, seed: int) -> None:
    import random

    rnd = random.Random(seed)
    files: dict[str, bytes] = {"big.bin": os.urandom(3 * MiB + 4097), "zeros": bytes(2 * MiB),
                               "dup1": b"same" * 9000, "d/dup2": b"same" * 9000}
    for i in range(600):
        n = rnd.choice([0, 10, 3000, 4096, 5000, 20_000, 70_000, 200_000])
        files[f"t{i % 17}/f{i}.txt"] = (f"line {i} ".encode() * (n // 7 + 1))[:n] if i % 3 else os.urandom(n)
    make_tree(root, files)


def test_data_cutter_closes_the_same_cuts_as_cut() -> None:
    """The streaming cut of the data area (chunking.DataCutter fed extent by extent) gives a prefix
    of `cut`'s data cuts."""
    import random

    from erofs_builder.chunking import DataCutter

    rnd = random.Random(5)
    for policy in (ChunkPolicy(), ChunkPolicy(min_group=16 << 10, target_group=64 << 10, max_group=128 << 10)):
        exts, pos = [], 4096
        for _i in range(3000):
            n = rnd.choice([4096, 8192, 4096 * rnd.randint(1, 40), 70 << 10, 3 * MiB + 8192])
            exts.append(DataExtent(pos, n, rnd.getrandbits(32)))
            pos += n
        layout = ImageLayout(size=pos, data_start=4096, data_end=pos, extents=tuple(exts))
        final = [c for c in cut(layout, policy) if not c.flags]
        cutter = DataCutter(4096, policy)
        streamed: list = []
        for e in exts:
            cutter.feed(e, streamed)
        assert len(streamed) > 100
        assert streamed == final[:len(streamed)]
        assert sum(c.length for c in final[len(streamed):]) < policy.max_group + 3 * MiB


def test_build_with_sink_compresses_every_distinct_chunk(tmp_path: Path) -> None:
    from erofs_builder.compress import MemorySink
    from layerstore import chunkobj

    _random_tree(tmp_path / "src", 1)
    plain = build_layer(dir_entries(tmp_path / "src"), tmp_path / "plain.img")
    sink = MemorySink()
    layer = build_layer(dir_entries(tmp_path / "src"), tmp_path / "sink.img", sink=sink)
    assert layer.path.read_bytes() == plain.path.read_bytes()  # the image does not change
    assert (layer.blob, layer.refs) == (plain.blob, plain.refs)
    unique = {r.digest: r for r in layer.refs}
    assert set(sink.objects) == set(unique)
    image = layer.path.read_bytes()
    for d, r in unique.items():
        assert chunkobj.decode(sink.objects[d], d) == image[r.offset:r.end]
    assert sink.stats.new_chunks == len(unique)
    assert sink.stats.new_bytes == sum(r.length for r in unique.values())


def test_build_with_store_sink_then_push_stores_only_the_map(tmp_path: Path) -> None:
    from erofs_builder.compress import StoreSink

    _random_tree(tmp_path / "src", 2)
    with Store.open(str(tmp_path / "store")) as store:
        store.init()
        layer = build_layer(dir_entries(tmp_path / "src"), tmp_path / "img", sink=StoreSink(store))
        unique = {r.digest for r in layer.refs}
        assert set(store.list_digests("chunks")) == unique
        assert not store.has_blob(layer.blob)  # the map only at push
        st = push_layer(store, layer)
        assert st.new_chunks == st.chunks == len(unique)
        assert store.has_blob(layer.blob)
        assert restored(store, layer.blob, tmp_path / "restored") == layer.path.read_bytes()
        assert store.verify().corrupt == []
        # a second build of the same tree compresses nothing: every chunk is there
        again = StoreSink(store)
        layer2 = build_layer(dir_entries(tmp_path / "src"), tmp_path / "img2", sink=again)
        assert layer2.blob == layer.blob and again.stats.new_chunks == 0
        # and a build on a parent: its chunks too
        (tmp_path / "src" / "t3" / "new.txt").write_bytes(os.urandom(50_000))
        child = build_layer(dir_entries(tmp_path / "src"), tmp_path / "child", parent=layer, sink=StoreSink(store))
        push_layer(store, child)
        assert restored(store, child.blob, tmp_path / "child.out") == child.path.read_bytes()


def test_failed_compression_fails_the_build_and_publishes_nothing(tmp_path: Path) -> None:
    import pytest

    from erofs_builder.compress import MemorySink

    class Broken(MemorySink):
        def put(self, chunk: str, obj: bytes, length: int) -> None:
            raise OSError("store went away")

    _random_tree(tmp_path / "src", 3)
    with pytest.raises(OSError, match="went away"):
        build_layer(dir_entries(tmp_path / "src"), tmp_path / "img", sink=Broken())
    assert not (tmp_path / "img").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["src"]
