"""Pure policy of `cache gc`: which cached blobs nothing uses and nobody used for a while.

A blob is kept when anything on the node uses it (an open handle, a durable pin, a chunk in
flight or held by a reader, or the daemon's in-use view), or when its last use is at or after the
cutoff; every other blob is forgotten (see `Forgetting.gc_unused`, docs/gc.md, the node side)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlobUse:
    blob: str
    held_bytes: int  # bytes of chunks on disk under a record (what forgetting frees)
    last_used: float  # seconds since the epoch (0: never)
    in_use: str = ""  # why it must stay whatever its age ("open", "pinned", ...); "" if nothing uses it


@dataclass
class UnusedChoice:
    victims: list[BlobUse]
    kept_in_use: list[BlobUse]
    kept_recent: list[BlobUse]


def choose_unused(uses: Iterable[BlobUse], cutoff: float) -> UnusedChoice:
    """Victims (oldest first): not in use and last used before `cutoff`."""
    choice = UnusedChoice([], [], [])
    for u in uses:
        if u.in_use:
            choice.kept_in_use.append(u)
        elif u.last_used >= cutoff:
            choice.kept_recent.append(u)
        else:
            choice.victims.append(u)
    choice.victims.sort(key=lambda u: (u.last_used, u.blob))
    return choice


def choose_over_budget(uses: Iterable[BlobUse], entries: Mapping[str, int], budget: int,
                       keep: str | None = None) -> list[BlobUse]:
    """Victims (least recently used first) whose chunk maps, forgotten, bring the entries held
    (`entries`: blob -> its map's entries) down to `budget`: blobs nothing uses, but `keep` (the
    map just added). Fewer, or none, if what nothing uses is not enough."""
    held = sum(entries.values())
    out: list[BlobUse] = []
    for u in sorted((u for u in uses if not u.in_use and u.blob != keep), key=lambda u: (u.last_used, u.blob)):
        if held <= budget:
            break
        out.append(u)
        held -= entries.get(u.blob, 0)
    return out
