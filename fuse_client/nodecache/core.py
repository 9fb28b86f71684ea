"""What the node cache's parts may call on its core (`NodeCache`): a narrow seam, not the cache.

The core (`cache.NodeCache`) owns the entries, the busy flights, the usage count and the journal
(queue, flush, commit record). Each part (`pins`, `verify`, `evictor`, `forgetting`) is an object
the core constructs with this interface and the few other collaborators it needs; it keeps its own
state (pins and protections, the verified count, the eviction episode and its counters, the map
budget) and reaches the core's state only through what is declared here. A part's unit test
hands it a fake core with just these members (tests/fuse_client/test_nodecache_parts.py).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from . import index as ci
from .entry import BlobEntry, Flight

Punch = tuple[str, list[tuple[int, int]]]  # (blob, [(offset, length), ...]) to punch once deleted


@runtime_checkable
class Core(Protocol):
    entries: dict[str, BlobEntry]  # blob -> entry; parts read it (only the core adds or removes)
    busy: dict[tuple[str, int], Flight]  # (blob, chunk) -> the one operation on it
    clock: Callable[[], float]

    @property
    def usage(self) -> int: ...

    def disk_bytes(self, entry: BlobEntry, i: int) -> int: ...

    def held_disk_bytes(self, entry: BlobEntry) -> int: ...

    def held_bytes(self, blobs: Container[str]) -> int: ...

    def data_path(self, blob: str) -> Path: ...

    def release(self, entry: BlobEntry, idxs: Sequence[int]) -> int: ...

    def remove_blob(self, blob: str) -> int: ...

    def count_corrupt(self, n: int) -> None: ...

    def pin(self, entry: BlobEntry, idxs: Sequence[int]) -> None: ...

    def unpin(self, entry: BlobEntry, idxs: Sequence[int]) -> None: ...

    def enqueue(self, ops: list[ci.Op], punches: Sequence[Punch] = ()) -> None: ...

    def queue_protected(self, blobs: list[str]) -> None: ...

    async def flush(self) -> None: ...

    async def flush_op(self, op: ci.Op) -> bool: ...
