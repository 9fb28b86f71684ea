"""Prefetch hints from a recorded access trace (pure).

The node daemon records, per blob, the chunk indexes a sandbox read, in first-access order:

    {"version": 1, "blobs": {"b3:...": [0, 7, 3, ...], ...}}

Other top-level fields are ignored (a recorder may add some within version 1). A trace recorded
on a node covers every blob it served, so only the environment's own layers are kept; an index
the blob does not have is an error (the trace was recorded for different content), and an index
seen again later (a re-read after eviction) keeps its first position.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from layerstore import digest as digestmod
from layerstore.errors import BadDigest

from . import canonical
from .canonical import kind_of
from .errors import InvalidManifest
from .schema import MAX_CHUNK_INDEX

TRACE_VERSION = 1


def parse_trace(data: bytes, where: str = "prefetch trace") -> dict[str, list[int]]:
    return parse_trace_json(canonical.loads(data, where), where)


def parse_trace_json(obj: Any, where: str = "prefetch trace") -> dict[str, list[int]]:
    if not isinstance(obj, Mapping):
        raise InvalidManifest(f"{where}: want an object, got {kind_of(obj)}")
    if "version" not in obj:
        raise InvalidManifest(f"{where}: missing field 'version'")
    version = obj["version"]
    if version != TRACE_VERSION or isinstance(version, bool):
        raise InvalidManifest(f"{where}: unknown trace version {version!r} (this layerctl reads {TRACE_VERSION})")
    if "blobs" not in obj:
        raise InvalidManifest(f"{where}: missing field 'blobs'")
    blobs = obj["blobs"]
    if not isinstance(blobs, Mapping):
        raise InvalidManifest(f"{where}: blobs: want an object of blob -> chunk indexes, got {kind_of(blobs)}")
    out: dict[str, list[int]] = {}
    for blob, indexes in blobs.items():
        w = f"{where}: blobs[{blob[:80]!r}]"
        try:
            digestmod.parse(blob)
        except BadDigest:
            raise InvalidManifest(f"{w}: not a digest (want 'b3:' + 64 lowercase hex digits)") from None
        if not isinstance(indexes, list):
            raise InvalidManifest(f"{w}: want a list of chunk indexes, got {kind_of(indexes)}")
        for j, idx in enumerate(indexes):
            if not isinstance(idx, int) or isinstance(idx, bool):
                raise InvalidManifest(f"{w}[{j}]: want a chunk index (a non-negative integer), got {kind_of(idx)}")
            if not 0 <= idx <= MAX_CHUNK_INDEX:
                raise InvalidManifest(f"{w}[{j}]: not a chunk index (negative, or beyond {MAX_CHUNK_INDEX})")
        out[blob] = list(indexes)
    return out


def prefetch_from_trace(trace: Mapping[str, list[int]], chunk_counts: Mapping[str, int],
                        where: str = "prefetch trace") -> dict[str, tuple[int, ...]]:
    """Prefetch hints for the layers in `chunk_counts` (blob -> number of chunks in its chunk map)."""
    hints: dict[str, tuple[int, ...]] = {}
    for blob, indexes in trace.items():
        if blob not in chunk_counts:
            continue
        count = chunk_counts[blob]
        seen: dict[int, None] = {}
        for j, idx in enumerate(indexes):
            if idx >= count:
                raise InvalidManifest(f"{where}: blob {blob}: entry {j} is chunk {idx}, "
                                      f"but the blob has {count} chunks")
            seen.setdefault(idx, None)
        if seen:
            hints[blob] = tuple(seen)
    return hints
