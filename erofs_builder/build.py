"""Build a layer image from entries, cut it into chunks, and push it to a store.

`build_layer` writes the image to a temporary file next to `out_path`, fsyncs it and renames it
into place only once it is complete and hashed: a crash leaves at most a stray `.*.tmp` file,
never a half-written image under the real name. `push_layer` stores every chunk before the
chunk map (the store's own write-order rule), so a crash leaves only unreferenced chunks.
"""

from __future__ import annotations

import contextlib
import gc
import mmap
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import blake3

from layerstore import digest as digestmod
from layerstore.chunkmap import ChunkMap, ChunkRef
from layerstore.errors import CorruptObject
from layerstore.fileio import fsync_dir
from layerstore.store import PutStats, Store

from .chunking import SLICE, ChunkPolicy, Cut, DataCutter, ImageLayout, cut
from .compress import BATCH as COMPRESS_BATCH
from .compress import ChunkSink, Compressor, StoreSink
from .erofs.format import BLOCK_SIZE
from .erofs.metadata import MAX_DEAD
from .erofs.parent import read_parent
from .erofs.writer import PACK_TAILS, ImageWriter
from .tree import Data, Entry, Kind

HASH_THREADS = max(2, os.cpu_count() or 2)
HASH_BATCH = 4 << 20
IMAGE_MODE = 0o644  # before the umask


@dataclass
class BuiltLayer:
    path: Path
    blob: str  # the image's id: its chunk list's (layerstore.chunkmap.blob_id)
    size: int
    files: int  # paths in the image, the root included
    refs: list[ChunkRef]
    layout: ImageLayout | None = None
    parent_used: bool = False  # built on a parent image (False also when the parent was set aside)
    # built with a `StoreSink`: every distinct chunk is in this store already (push_layer then
    # stores only the chunk map), with what storing them added
    chunks_in: Store | None = field(default=None, repr=False, compare=False)
    chunk_stats: PutStats | None = field(default=None, repr=False, compare=False)


# A parent: a layer built earlier, or an image file and its chunk map.
Parent = BuiltLayer | tuple[Path, Sequence[ChunkRef]]
BS = BLOCK_SIZE


def build_layer(entries: Iterable[tuple[Entry, Data | None]], out_path: Path, *, mtime_clamp: int | None = None,
                all_root: bool = False, progress: Callable[[int], None] | None = None,
                pack_tails: bool | int = PACK_TAILS, policy: ChunkPolicy | None = None, parent: Parent | None = None,
                max_dead: float = MAX_DEAD, sink: ChunkSink | None = None) -> BuiltLayer:
    """Write the image for `entries` to `out_path` and cut it into chunks. `progress` is called
    with the number of content bytes each added entry carried.

    With `parent` (an earlier build of the same tree), data and inode records the parent already
    holds keep their addresses, and new or changed ones are appended, so that the image shares
    all but the changed parts' chunks with it. A parent whose data area is more than `max_dead`
    unreferenced is set aside, and the image is laid out afresh; so is its metadata area alone
    when less than 1 - `max_dead` of its blocks would still hold a record.

    With `sink` (see compress.py), every distinct chunk of the image is also compressed as a
    chunk object and handed to the sink (a `StoreSink` stores it: `push_layer` then only adds
    the chunk map), in worker threads while the image is built."""
    with _no_gc():
        return _build(entries, Path(out_path), mtime_clamp=mtime_clamp, all_root=all_root, progress=progress,
                      pack_tails=pack_tails, policy=policy, parent=parent, max_dead=max_dead, sink=sink)


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """The cyclic collector off while building: a build allocates a few objects per entry and
    frees none until the end, so the collector's passes (8 % of a build's time) find nothing.
    Reference counting still frees everything acyclic; the state is restored afterwards."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _build(entries: Iterable[tuple[Entry, Data | None]], out_path: Path, *, mtime_clamp: int | None,
           all_root: bool, progress: Callable[[int], None] | None, pack_tails: bool | int,
           policy: ChunkPolicy | None, parent: Parent | None, max_dead: float,
           sink: ChunkSink | None) -> BuiltLayer:
    par = None
    if parent is not None:
        path, refs = (parent.path, parent.refs) if isinstance(parent, BuiltLayer) else parent
        par = read_parent(path, refs)
        if par.dead_data > max_dead * (par.data_end - BS):
            par = None
    fd, tmp = tempfile.mkstemp(prefix=f".{out_path.name}.", suffix=".tmp", dir=out_path.parent)
    comp: Compressor | None = None
    try:
        with os.fdopen(fd, "w+b", buffering=1 << 20) as f:
            writer = ImageWriter(f, mtime_clamp=mtime_clamp, all_root=all_root, pack_tails=pack_tails, parent=par,
                                 max_dead=max_dead)
            if sink is None:
                for entry, data in entries:
                    writer.add(entry, data)
                    if progress is not None:
                        progress(entry.size if entry.kind is Kind.REG and entry.hardlink is None else 0)
            else:
                comp = Compressor(f.fileno(), sink)
                _add_compressing(writer, f, entries, progress, comp, policy)
            with ThreadPoolExecutor(2) as syncer:
                # the data area goes to disk, and its chunks are hashed, while the metadata is laid
                # out; the rest goes to disk while the image is hashed (from the page cache);
                # fsync and blake3 release the GIL
                f.flush()
                early = syncer.submit(os.fdatasync, f.fileno())
                pre = _prehash(syncer, f.fileno(), writer.data_layout(), policy,
                               skip=comp.submitted if comp is not None else None)
                layout = writer.finish()
                f.flush()
                synced = syncer.submit(os.fsync, f.fileno())
                known = pre.result()
                if comp is not None:
                    comp.wait()  # the streamed chunks' digests
                    known.update(comp.digests)
                blob, refs = hash_image(f.fileno(), layout, policy, known=known)
                if comp is not None:
                    # what was not streamed: the last data group, metadata, a parent's data
                    digests = {(r.offset, r.length): r.digest for r in refs}
                    comp.submit_batched((Cut(r.offset, r.length) for r in refs
                                         if (r.offset, r.length) not in comp.submitted), digests)
                    comp.wait()
                    comp.sink.flush()  # every object where it goes (stored, for a StoreSink)
                early.result()
                synced.result()
            # mkstemp made it 0600; the published image gets what a plain create would give
            os.fchmod(f.fileno(), IMAGE_MODE & ~current_umask())
        os.replace(tmp, out_path)
    except BaseException:
        if comp is not None:
            comp.close(cancel=True)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if comp is not None:
        comp.close()
    fsync_dir(out_path.parent)
    layer = BuiltLayer(path=out_path, blob=blob, size=layout.size, files=layout.files, refs=refs, layout=layout,
                       parent_used=par is not None)
    if isinstance(sink, StoreSink):
        layer.chunks_in = sink.store
        layer.chunk_stats = PutStats(chunks=len({r.digest for r in refs}), new_chunks=sink.stats.new_chunks,
                                     new_bytes=sink.stats.new_bytes, stored_bytes=sink.stats.stored_bytes)
    return layer


def _add_compressing(writer: ImageWriter, f: BinaryIO, entries: Iterable[tuple[Entry, Data | None]],
                     progress: Callable[[int], None] | None, comp: Compressor, policy: ChunkPolicy | None) -> None:
    """`writer.add` every entry, handing the data chunks that close on the way to `comp`
    (flushed to the file first, in batches of about `compress.BATCH` bytes)."""
    cutter = DataCutter(writer.data_pos, policy)
    big_slices = cutter.policy.max_chunk == SLICE  # big runs are cut where the writer hashed them
    extents = writer.data_extents
    seen = 0
    pending: list[Cut] = []
    pending_bytes = 0
    for entry, data in entries:
        writer.add(entry, data)
        if progress is not None:
            progress(entry.size if entry.kind is Kind.REG and entry.hardlink is None else 0)
        n = len(extents)
        if n == seen:
            continue
        before = len(pending)
        for ext in extents[seen:n]:
            cutter.feed(ext, pending)
            if ext.slices and big_slices:
                for i, d in enumerate(ext.slices):
                    comp.known[(ext.offset + i * SLICE, min(SLICE, ext.length - i * SLICE))] = d
        seen = n
        for c in pending[before:]:
            pending_bytes += c.length
        if pending_bytes >= COMPRESS_BATCH:
            f.flush()
            comp.submit(pending)
            pending, pending_bytes = [], 0
    f.flush()
    comp.submit(pending)
    comp.full_speed()


def _batches(cuts: Iterable[Cut], known: dict[tuple[int, int], bytes]) -> list[list[Cut]]:
    """The cuts whose digests are not known, a few MiB per task (one future per chunk costs
    more than small chunks' hashing)."""
    batches: list[list[Cut]] = [[]]
    size = 0
    for c in cuts:
        if (c.offset, c.length) in known:
            continue
        if size >= HASH_BATCH:
            batches.append([])
            size = 0
        batches[-1].append(c)
        size += c.length
    return batches


def _digests(view: memoryview, cs: list[Cut]) -> list[bytes]:
    return [blake3.blake3(view[c.offset:c.offset + c.length]).digest() for c in cs]


def _known(layout: ImageLayout) -> dict[tuple[int, int], bytes]:
    """Digests the writer computed while writing: big runs' `SLICE` pieces."""
    known: dict[tuple[int, int], bytes] = {}
    for e in layout.extents:
        for i, d in enumerate(e.slices):
            known[(e.offset + i * SLICE, min(SLICE, e.length - i * SLICE))] = d
    return known


def _prehash(pool: ThreadPoolExecutor, fd: int, data: ImageLayout, policy: ChunkPolicy | None,
             skip: set[tuple[int, int]] | None = None) -> Future[dict[tuple[int, int], bytes]]:
    """Start hashing the data area's chunks in a thread (the writer's `data_layout`: its cuts do
    not change when the metadata follows; nothing in it is written again). The future gives
    their digests by (offset, length). `skip`: cuts hashed elsewhere (by the compressor)."""
    known = _known(data)
    todo = [c for batch in _batches(cut(data, policy), known) for c in batch
            if not c.flags and not (skip and (c.offset, c.length) in skip)]

    def run() -> dict[tuple[int, int], bytes]:
        if not todo:
            return {}
        with image_view(fd, data.size) as view:
            return {(c.offset, c.length): d for c, d in zip(todo, _digests(view, todo), strict=True)}

    return pool.submit(run)


def hash_image(fd: int, layout: ImageLayout, policy: ChunkPolicy | None = None,
               known: dict[tuple[int, int], bytes] | None = None) -> tuple[str, list[ChunkRef]]:
    """The image's id and its chunk refs (digests filled), hashed in threads. The id is the
    one the chunk list gives the image (`layerstore.chunkmap.blob_id`: a tree hash over the
    size and every chunk's offset, length, flags and digest), so its chunk map proves it.
    `known`: digests already computed, by (offset, length)."""
    cuts = cut(layout, policy)
    if not layout.size:
        return ChunkMap.build([]).blob, []
    known = {**_known(layout), **(known or {})}
    batches = _batches(cuts, known)
    with image_view(fd, layout.size) as view, ThreadPoolExecutor(HASH_THREADS) as pool:
        hashed = iter([d for ds in pool.map(lambda cs: _digests(view, cs), batches) for d in ds])
        digests = [digestmod.PREFIX + (known.get((c.offset, c.length)) or next(hashed)).hex() for c in cuts]
    refs = [ChunkRef(c.offset, c.length, d, c.flags) for c, d in zip(cuts, digests, strict=True)]
    return ChunkMap.build(refs).blob, refs  # the build checks the cover


@contextlib.contextmanager
def image_view(fd: int, size: int) -> Iterator[memoryview]:
    """The first `size` bytes of an image file, mapped read-only (released on exit)."""
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mm:
        view = memoryview(mm)
        try:
            yield view
        finally:
            view.release()


def push_layer(store: Store, layer: BuiltLayer, progress: Callable[[int], None] | None = None) -> PutStats:
    """Store the layer's missing chunks (in parallel), then its chunk map. A layer built with a
    `StoreSink` of this store has its chunks stored (compressed while it was built): only the
    chunk map is stored, after the store has checked that every chunk it names is present."""
    if layer.chunks_in is store and layer.chunk_stats is not None:
        store.put_chunk_map(_chunk_map(layer))
        if progress is not None:
            progress(layer.size)
        return layer.chunk_stats
    unique: dict[str, ChunkRef] = {}
    for ref in layer.refs:
        unique.setdefault(ref.digest, ref)
    todo = list(unique.values())
    stats = PutStats()
    fd = os.open(layer.path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        def payloads() -> Iterator[bytes]:
            for ref in todo:
                yield os.pread(fd, ref.length, ref.offset)

        for ref, (digest, st) in zip(todo, store.put_chunks(payloads()), strict=True):
            if digest != ref.digest:
                raise CorruptObject(f"{layer.path}: bytes at {ref.offset} changed since the image was built")
            stats.add(st)
            if progress is not None:
                progress(ref.length)
    finally:
        os.close(fd)
    store.put_chunk_map(_chunk_map(layer))
    return stats


def _chunk_map(layer: BuiltLayer) -> ChunkMap:
    cm = ChunkMap.build(layer.refs)
    if cm.blob != layer.blob:
        raise CorruptObject(f"{layer.path}: its chunk list is {cm.blob}, not the {layer.blob} it was built as")
    return cm


def current_umask() -> int:
    """The process umask, read without changing it (os.umask would race with other threads)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
