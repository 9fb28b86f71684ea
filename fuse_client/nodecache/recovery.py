"""Recovery of the node cache at start-up (blocking; run in a worker thread before serving): the
LMDB index and the data files made to agree, every recorded chunk kept unverified until it is
re-hashed, unless the verified seal of a clean close vouches for it (`seal`; see docs/fuse-client.md,
"What is verified when", and the crash table)."""

from __future__ import annotations

import bisect
import logging
from pathlib import Path

from layerstore.chunkmap import ChunkMap
from layerstore.errors import CorruptObject
from layerstore.linux import data_extents

from . import index as ci
from . import seal
from .cache import NodeCache, read_protected
from .files import BlobFiles, punch_hole

log = logging.getLogger("layerstore.fuse.cache")


def recover(root: Path, files: BlobFiles, index: ci.CacheIndex, **kw: object) -> NodeCache:
    """Load the index and make the data files agree with it: committed chunks whose bytes
    are missing lose their record, bytes without a record are punched out, data files
    without a map are removed. Recorded chunks whose bytes are there are kept *unverified*:
    counted in usage (their stored length in a zstd cache: what they occupy on disk), evictable,
    but served only once re-hashed (`check_unverified`). The files of pinned and protected blobs
    (`Pins.protect`: mounted directly) are never punched: their unrecorded bytes stay
    (not served; a fetch writes over them) until a recovery finds the blob unprotected."""
    cache = NodeCache(root, files, index, **kw)  # type: ignore[arg-type]
    files.ensure_reserve()
    committed = index.committed()
    stored = index.stored_lengths() if cache.compressed else {}
    pins = cache.holds.pinned = index.pins()
    protected = cache.holds.protected = read_protected(root)
    sealed = seal.take(root)  # (removed now: a crash from here on leaves none)
    ops: list[ci.Op] = []
    dropped = punched = kept = trusted = 0
    for blob, data in index.maps():
        try:
            cmap = ChunkMap.decode(data, blob)
        except CorruptObject as e:
            log.warning("cache: dropping blob %s with a corrupt chunk map: %s", blob, e)
            ops.append(ci.DelBlob(blob))
            if blob not in pins and blob not in protected:  # a mounted file stays until its mounts are gone
                files.remove(blob)
            committed.pop(blob, None)
            continue
        recs = committed.pop(blob, {})
        lengths = stored.get(blob, {})
        fd = files.open(blob, cmap.size)
        entry = cache.new_entry(cmap, fd)
        # (before any punch of this file below: a punch changes its identity)
        vouched = seal.trusted(sealed.get(blob), fd, data, len(cmap.chunks))
        extents = list(data_extents(fd, cmap.size))
        starts = [s for s, _ in extents]
        for idx, last_use in recs.items():
            ref = cmap.chunks[idx] if idx < len(cmap.chunks) else None
            # A zstd cache's chunk occupies its stored length from its offset (its frame).
            n = lengths.get(idx, 0) if entry.stored is not None else (ref.length if ref is not None else 0)
            if ref is None or not 0 < n <= ref.length or not covered(extents, starts, ref.offset, ref.offset + n):
                ops.append(ci.DelChunk(blob, idx))
                dropped += 1
                continue
            if entry.stored is not None:
                entry.stored[idx] = n
            entry.unverified[idx] = 1
            entry.last_use[idx] = last_use
            cache.usage += n
            kept += 1
        for a, b in vouched:  # recorded chunks the seal vouches for: verified by the process that closed it
            for idx in range(a, b):
                if entry.unverified[idx]:
                    entry.unverified[idx] = 0
                    entry.present[idx] = 1
                    trusted += 1
        if blob in protected:
            extents = []  # (a front end mounted it: a read it allowed may still be copying these)
        if blob in pins:
            # Never touch the bytes of a pinned file: a holder mounted it as an image.
            lost = entry.size - entry.held_bytes()
            if lost:
                log.error("cache recovery: pinned blob %s lacks %d byte(s) of committed chunks; its "
                          "direct mounts read zeros there until they are fetched again", blob, lost)
            extents = []
        for s, e in extents:
            for idx in cmap.span(s, e - s):
                if not entry.present[idx] and not entry.unverified[idx]:
                    ref = cmap.chunks[idx]
                    lo, hi = max(s, ref.offset), min(e, ref.end)
                    punch_hole(fd, lo, hi - lo)
                    punched += 1
        cache.entries[blob] = entry
    for blob in committed:  # records without a map
        ops.append(ci.DelBlob(blob))
    for blob in list(files.blobs()):
        if blob not in cache.entries and blob not in pins and blob not in protected:
            files.remove(blob)
    if ops:
        index.apply(ops)
    if dropped or punched:
        log.warning("cache recovery: %d record(s) without data dropped, %d uncommitted range(s) punched",
                    dropped, punched)
    if kept > trusted:
        log.info("cache recovery: %d committed chunk(s) kept unverified: each is re-hashed before it is served",
                 kept - trusted)
    if trusted:
        log.info("cache recovery: %d committed chunk(s) served at once: the verified seal of a clean close vouches "
                 "for them", trusted)
    return cache


def covered(extents: list[tuple[int, int]], starts: list[int], lo: int, hi: int) -> bool:
    """Is [lo, hi) inside one data extent?"""
    k = bisect.bisect_right(starts, lo) - 1
    return k >= 0 and extents[k][1] >= hi
