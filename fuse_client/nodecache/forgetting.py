"""Forgetting whole blobs: `cache gc` of unused blobs, and the chunk-map budget.

A part the core (`cache.NodeCache`) owns, built with the core's narrow seam (`core.Core`) and the
blobs' holds (`pins.Holds`); it owns the map budget, its counter and the daemon's in-use view;
the policy (which blobs) is pure, in `unused`.
Forgetting a blob drops its entry, data file and (with the next journal batch) its records and
map; never a blob that is pinned, protected, open, in flight or held by a reader.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence

import trio

from layerstore.errors import BadInput

from .core import Core
from .pins import Holds
from .unused import BlobUse, choose_over_budget, choose_unused

log = logging.getLogger("layerstore.fuse.cache")

class Forgetting:
    """Forgetting blobs nothing uses (`gc_unused`, `forget_idle_maps`)."""

    def __init__(self, core: Core, holds: Holds, map_budget: int = 0) -> None:
        self.core = core
        self.holds = holds
        # Chunk-map entries the node keeps in memory (0: no limit): past it, adding a map forgets
        # the least recently used blobs nothing uses (`forget_idle_maps`; issue 27).
        self.map_budget = map_budget
        self.maps_forgotten = 0
        # blob -> when (wall clock) something beyond an open handle or a pin last used it, inf
        # while it is in use: set by the daemon (the node lease's view: lookups, prefetches, pins
        # in progress, mounts); for `gc_unused`.
        self.in_use: Callable[[], Mapping[str, float]] | None = None

    def map_entries(self) -> int:
        """Entries of the chunk maps held in memory (each ~`chunkmap.DECODED_ENTRY` bytes)."""
        return sum(len(e.cmap.chunks) for e in self.core.entries.values())

    def forget_idle_maps(self, keep: str | None = None) -> list[str]:
        """Trio thread, no await: while the maps held exceed `map_budget` entries, forget the
        least recently used blobs that nothing uses (`forget_blob`: the map, the cached chunks,
        the data file; a later lookup fetches the map again), never `keep`. Returns them."""
        sizes = {blob: len(e.cmap.chunks) for blob, e in self.core.entries.items()}
        if sum(sizes.values()) <= self.map_budget:
            return []
        forgotten = [u.blob for u in choose_over_budget(self.blob_uses(), sizes, self.map_budget, keep)
                     if self.forget_blob(u.blob) is not None]
        if forgotten:
            self.maps_forgotten += len(forgotten)
            log.info("cache: forgot %d unused blob(s) to keep chunk maps within %d entries (%d held)",
                     len(forgotten), self.map_budget, self.map_entries())
        return forgotten

    def blob_uses(self, file_times: Mapping[str, float] | None = None) -> list[BlobUse]:
        """Every blob's use (see `unused`): why it must stay, if anything uses it, and its last
        use: the latest of its chunks' last use, `file_times` (its data file's last write) and
        the daemon's in-use view (`in_use`)."""
        seen = self.in_use() if self.in_use is not None else {}
        files = file_times or {}
        core, holds = self.core, self.holds
        busy = {blob for blob, _ in core.busy}
        out = []
        for blob, e in core.entries.items():
            daemon = seen.get(blob, 0.0)
            why = ("pinned" if blob in holds.pinned else "protected" if blob in holds.protected
                   else "open" if e.open_count else "busy" if blob in busy
                   else "reading" if e.pins else "in use" if daemon == math.inf else "")
            last = max(max(e.last_use, default=0.0), files.get(blob, 0.0), daemon if daemon != math.inf else 0.0)
            out.append(BlobUse(blob, core.held_disk_bytes(e), last, why))
        return out

    def _file_times(self, blobs: Sequence[str]) -> dict[str, float]:
        out = {}
        for blob in blobs:
            try:
                out[blob] = os.stat(self.core.data_path(blob)).st_mtime
            except OSError:
                continue
        return out

    async def gc_unused(self, older_than: float, *, dry_run: bool = False) -> dict[str, object]:
        """Forget every blob nothing uses and nobody used for `older_than` seconds (see
        `unused.choose_unused`); never one that is pinned, open, in flight or in use."""
        if older_than < 0:
            raise BadInput(f"older than {older_than} s: want a duration >= 0")
        core = self.core
        times = await trio.to_thread.run_sync(self._file_times, list(core.entries))
        now = core.clock()
        choice = choose_unused(self.blob_uses(times), now - older_than)
        dropped: list[dict[str, object]] = []
        freed = 0
        for u in choice.victims:
            if dry_run:
                dropped.append({"blob": u.blob, "bytes": u.held_bytes, "last_used": u.last_used})
                freed += u.held_bytes
                continue
            n = self.forget_blob(u.blob)  # (no await in between: the choice still holds)
            if n is not None:
                dropped.append({"blob": u.blob, "bytes": n, "last_used": u.last_used})
                freed += n
        if dropped and not dry_run:
            with trio.CancelScope(shield=True):
                await core.flush()
            log.info("cache gc: forgot %d blob(s) unused for %g s, %d bytes", len(dropped), older_than, freed)
        return {"dry_run": dry_run, "older_than": older_than, "dropped": dropped, "dropped_blobs": len(dropped),
                "dropped_bytes": freed, "kept_in_use": len(choice.kept_in_use),
                "kept_recent": len(choice.kept_recent), "used_bytes": core.usage}

    def forget_blob(self, blob: str) -> int | None:
        """Trio thread, no await: take the blob out of the cache (its entry, data file and, at the
        next batch, its index records and map). Returns the bytes it held, or None if something
        uses it (pinned, open, in flight, held by a reader) or it is unknown."""
        core = self.core
        e = core.entries.get(blob)
        if (e is None or self.holds.held(blob) or e.open_count or e.pins
                or any(b == blob for b, _ in core.busy)):
            return None
        return core.remove_blob(blob)
