"""The verified seal: what a clean close of the node cache vouches for, so that the next open
serves it without re-hashing (docs/fuse-client.md, "What is verified when").

    DIR/verified.seal   JSON: for each blob, the chunks this process had verified (`present`),
                        the identity of its data file when the cache closed (device, inode,
                        size, allocated blocks, mtime and ctime in ns) and the blake3 of its
                        chunk map; written at a clean close (synced, renamed, the directory
                        synced), removed by the next open before it serves anything.

A record in the index says the bytes were verified once; recovery cannot tell whether they were
changed while no daemon ran, so it keeps recorded chunks *unverified* (each re-hashed on first
use: a worker-thread hop and a blake3 per chunk on every first read after a restart). The seal
narrows that: a data file whose identity is what the closing process saw was not written since
(any write, truncate or punch moves its ctime, which no one can set back without setting the
clock), so the chunks the seal lists are still the bytes that were verified. A crash leaves no
seal (the open removed it), and every rule of recovery then applies as before.

Pure logic and blocking file I/O only; `NodeCache.close` (`snapshot` of each entry, `write`) and
`recovery.recover` (`take`, `trusted`) call it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import blake3

from layerstore import digest as digestmod
from layerstore.errors import LayerstoreError
from layerstore.fileio import fsync_dir, write_atomic

log = logging.getLogger("layerstore.fuse.cache")

SEAL_NAME = "verified.seal"
VERSION = 1
# A write in the same tick of the kernel's coarse clock as the file's last change leaves its
# ctime as it was: the seal is taken only once the clock has moved past every file's ctime by
# this much (a clean close waits at most this long, and only after a write just before it).
CLOCK_MARGIN = 0.03


@dataclass(frozen=True)
class Sealed:
    """One blob in the seal: its data file's identity, its chunk map's blake3 and the verified
    chunks as [start, stop) runs."""

    file: tuple[int, ...]
    map_digest: str
    runs: tuple[tuple[int, int], ...]

    def to_json(self) -> dict[str, object]:
        return {"file": list(self.file), "map": self.map_digest, "runs": [list(r) for r in self.runs]}

    @classmethod
    def from_json(cls, d: Mapping[str, object]) -> Sealed:
        file, runs, m = d["file"], d["runs"], d["map"]
        if not (isinstance(file, list) and len(file) == 6 and all(isinstance(x, int) for x in file)):
            raise ValueError("bad file identity")
        if not isinstance(m, str) or not isinstance(runs, list):
            raise ValueError("bad map digest or runs")
        out = []
        for r in runs:
            if not (isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) for x in r) and 0 <= r[0] < r[1]):
                raise ValueError(f"bad run {r!r}")
            out.append((r[0], r[1]))
        return cls(tuple(file), m, tuple(out))


def file_identity(st: os.stat_result) -> tuple[int, ...]:
    """What any change of a data file's bytes changes: device, inode, size, allocated blocks,
    mtime and ctime (ns)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_blocks, st.st_mtime_ns, st.st_ctime_ns)


def map_digest(encoded_map: bytes) -> str:
    return blake3.blake3(encoded_map).hexdigest()


def runs_of(present: bytearray) -> tuple[tuple[int, int], ...]:
    """The [start, stop) runs of set bytes."""
    runs = []
    i, n = 0, len(present)
    while True:
        i = present.find(1, i)
        if i < 0:
            break
        j = present.find(0, i)
        if j < 0:
            j = n
        runs.append((i, j))
        i = j
    return tuple(runs)


def settle_clock(ctimes_ns: list[int], margin: float = CLOCK_MARGIN) -> None:
    """Sleep until the wall clock is `margin` past the latest ctime (see CLOCK_MARGIN)."""
    if ctimes_ns:
        wait = max(ctimes_ns) / 1e9 + margin - time.time()
        if wait > 0:
            time.sleep(min(wait, margin))


def write(root: Path, blobs: Mapping[str, Sealed]) -> None:
    """Blocking: DIR/verified.seal replaced atomically and durably (the data files' bytes the
    seal vouches for were synced before the records that made them recovered chunks)."""
    doc = {"version": VERSION, "blobs": {b: s.to_json() for b, s in sorted(blobs.items())}}
    write_atomic(Path(root) / SEAL_NAME, json.dumps(doc, separators=(",", ":")).encode())


def take(root: Path) -> dict[str, Sealed]:
    """Blocking, at open before anything is served: read the seal and remove it durably (a crash
    from here on leaves none). {} if there is none, or it is unreadable, or cannot be removed
    (then it is not trusted)."""
    path = Path(root) / SEAL_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as e:
        log.warning("cache: cannot read %s (%s): recovered chunks are re-hashed before they are served", path, e)
        return {}
    try:
        os.unlink(path)
        fsync_dir(path.parent)
    except OSError as e:
        log.warning("cache: cannot remove %s (%s): not trusted", path, e)
        return {}
    try:
        doc = json.loads(raw)
        if doc.get("version") != VERSION:
            raise ValueError(f"version {doc.get('version')!r}")
        return {digestmod.parse(b): Sealed.from_json(d) for b, d in doc["blobs"].items()}
    except (ValueError, KeyError, TypeError, AttributeError, LayerstoreError) as e:
        log.warning("cache: %s is malformed (%s): recovered chunks are re-hashed before they are served", path, e)
        return {}


def trusted(sealed: Sealed | None, fd: int, encoded_map: bytes, n_chunks: int) -> tuple[tuple[int, int], ...]:
    """The runs of verified chunks the seal vouches for in this data file: all of them if the
    file's identity and the chunk map are what the seal recorded, else none."""
    if sealed is None:
        return ()
    with contextlib.suppress(OSError):
        if file_identity(os.fstat(fd)) == sealed.file and map_digest(encoded_map) == sealed.map_digest:
            return tuple((a, min(b, n_chunks)) for a, b in sealed.runs if a < n_chunks)
    return ()
